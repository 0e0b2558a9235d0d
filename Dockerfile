# The ledger worker (and the `ledger` command): compaction and hard-reset jobs, lease expiry.
#   docker build -t redis-token-ledger .
#   docker run --rm --init -e LEDGER_REDIS_URL=redis://host:6379/0 \
#     -e LEDGER_WORKER_COMPACTOR=ledger.adapters.summarizer:openai_from_env redis-token-ledger
#   docker run --rm -e LEDGER_REDIS_URL=redis://host:6379/0 redis-token-ledger ledger audit
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the wheel is built from: ledger/, with the worker (ledger/workers) and the
# Lua scripts (ledger/lua) inside it (one import name, `ledger`).
COPY pyproject.toml README.md ./
COPY ledger ./ledger
# The worker's extras: its metrics (worker) and the LLM compactor docker-compose.yml
# names (summarizer); and the admin commands' output (cli), so that
# `docker compose exec worker ledger audit` (top, inspect) works. Not the embedded backend.
RUN pip install ".[worker,summarizer,cli]" \
    && rm -rf /src \
    && useradd --create-home --uid 10001 ledger

USER ledger
WORKDIR /home/ledger
ENV LEDGER_REDIS_URL=redis://redis:6379/0
# the worker's Prometheus metrics, when LEDGER_WORKER_METRICS_PORT (or --metrics-port) is 9464
EXPOSE 9464
CMD ["ledger", "worker"]
