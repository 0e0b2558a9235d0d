# The ledger worker (and the `ledger` command): compaction and hard-reset jobs, lease expiry.
#   docker build -t redis-token-ledger .
#   docker run --rm --init -e LEDGER_REDIS_URL=redis://host:6379/0 \
#     -e LEDGER_WORKER_COMPACTOR=ledger.adapters.summarizer:openai_from_env redis-token-ledger
#   docker run --rm -e LEDGER_REDIS_URL=redis://host:6379/0 redis-token-ledger ledger audit
# The base image pinned to a patch release and Debian release (a digest pin,
# python:3.11.9-slim-bookworm@sha256:..., is the registry's: add it where you build).
FROM python:3.11.9-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the wheel is built from: ledger/, with the worker (ledger/workers) inside it,
# and lua/, the Lua scripts the wheel maps into the package as ledger/lua (one import
# name, `ledger`).
COPY pyproject.toml README.md ./
COPY deploy/constraints.txt ./
COPY ledger ./ledger
COPY lua ./lua
# The worker's extras: its metrics (worker) and the LLM compactor docker-compose.yml
# names (summarizer); and the admin commands' output (cli), so that
# `docker compose exec worker ledger audit` (top, inspect) works. Not the embedded backend.
RUN pip install -c constraints.txt ".[worker,summarizer,cli]" \
    && rm -rf /src \
    && useradd --create-home --uid 10001 ledger

USER ledger
WORKDIR /home/ledger
# No Redis URL is baked in: LEDGER_REDIS_URL names it (the worker exits 2 without one).
# The worker's /metrics, /healthz and /readyz on 9464 (LEDGER_WORKER_METRICS_PORT and
# LEDGER_WORKER_METRICS_HOST change them); the health check asks /healthz where those
# settings say (python -m ledger.workers.http) and fails once the job loop has not
# turned for 90 s (docs/operations.md).
ENV LEDGER_WORKER_METRICS_PORT=9464
EXPOSE 9464
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-m", "ledger.workers.http", "healthz"]
CMD ["ledger", "worker"]
