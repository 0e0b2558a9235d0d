"""``ledger worker``: the background worker (``ledger.workers``) run as a process."""

from __future__ import annotations

import argparse

from ledger.cli.common import EXIT_OK, _settings
from ledger.errors import ConfigurationError, LedgerError
from ledger.extras import need
from ledger.settings import require_url


def cmd_worker(args: argparse.Namespace) -> int:
    """The worker logs JSON lines and prints nothing else: it needs no console."""
    import logging
    import signal
    import threading

    import redis

    from ledger.client import Ledger
    from ledger.workers.compactors import NO_COMPACTOR
    from ledger.workers.runner import JsonFormatter, Worker, WorkerSettings

    need("prometheus_client", "worker", "ledger worker")

    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    overrides: dict[str, object] = {}
    names: tuple[str, ...] = ("compactor", "consumer", "metrics_port", "claim_idle_ms")
    names += ("max_deliveries", "metrics_host", "drain_seconds")
    for name in (*names, "max_in_flight"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.interval is not None:
        overrides["sweep_interval"] = args.interval
    if args.log_level is not None:
        overrides["log_level"] = args.log_level
    wsettings = WorkerSettings(**overrides)  # type: ignore[arg-type]
    logging.basicConfig(level=wsettings.log_level.upper(), handlers=[handler], force=True)
    settings = _settings(args)
    require_url(settings)
    if wsettings.compactor is None:
        raise ConfigurationError(NO_COMPACTOR)
    stop = threading.Event()
    said: list[str] = []  # the signal that stopped the worker (its log names it)

    def on_signal(signum: int, _frame: object) -> None:
        said.append(signal.Signals(signum).name)
        stop.set()  # no job starts from now on; the loop drains and says so

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
    with Ledger.from_settings(settings) as ledger:
        try:
            worker = Worker(ledger, wsettings)
        except (LedgerError, redis.RedisError):
            raise
        except Exception as exc:  # the compactor's import or its check() raised
            raise ConfigurationError(
                f"the compactor {wsettings.compactor!r} cannot work: {type(exc).__name__}: {exc}"
            ) from exc
        worker.signals = said
        http = None
        if wsettings.metrics_port:  # /metrics, /healthz (the job loop turns), /readyz
            from ledger.workers.http import serve

            http = serve(
                worker,
                wsettings.metrics_port,
                wsettings.health_stale_seconds,
                host=wsettings.metrics_host,
            )
        try:
            worker.run(stop, once=args.once)
            if args.once:
                worker.sweep()
        finally:
            if http is not None:
                http.shutdown()
                http.server_close()
            worker.close()
    return EXIT_OK
