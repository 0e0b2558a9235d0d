"""The ``ledger`` command: ``demo``, ``audit``, ``worker``.

Exit codes: 0 success; 1 an audit found violations or the demo's checks failed;
2 bad usage or configuration; 3 Redis unavailable.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from ledger.errors import BackendUnavailable, ConfigurationError, InvalidArgument, LedgerError
from ledger.settings import LedgerSettings

EXIT_OK, EXIT_VIOLATION, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


def _settings(args: argparse.Namespace) -> LedgerSettings:
    overrides: dict[str, str] = {}
    if args.url:
        overrides["redis_url"] = args.url
    if args.prefix:
        overrides["prefix"] = args.prefix
    return LedgerSettings(**overrides)  # type: ignore[arg-type]


def cmd_demo(args: argparse.Namespace, out: Console) -> int:
    from ledger import demo

    settings = _settings(args)
    out.print(
        f"[bold]ledger demo[/]: {args.workers} workers share one session budget on "
        f"[cyan]{settings.redis_url}[/] ({args.turns} turns each, 20% of calls retried)"
    )
    res = demo.run(settings, workers=args.workers, turns=args.turns, seed=args.seed)
    table = Table(title="per worker")
    for col in ("worker", "calls", "retries (same op id)", "tokens charged", "refused"):
        table.add_column(col, justify="right")
    for s in res.stats:
        refusals = str(sum(s.refusals.values()))
        table.add_row(s.name, str(s.calls), str(s.retries), str(s.charged), refusals)
    out.print(table)
    snap, audit = res.snapshot, res.audit
    out.print(
        f"window {snap.window}, free {snap.free} (never below 0), utilization "
        f"{snap.utilization:.2f}, residual working memory {snap.residual_working_memory}, "
        f"refusals {snap.refusals}"
    )
    verdict = "[green]clean[/]" if audit.clean else f"[red]VIOLATIONS {audit.problems}[/]"
    out.print(f"audit: {verdict}; {res.elapsed:.2f} s")
    return EXIT_OK if audit.clean and snap.free >= 0 else EXIT_VIOLATION


def cmd_audit(args: argparse.Namespace, out: Console) -> int:
    from ledger.client import Ledger

    with Ledger.from_settings(_settings(args)) as ledger:
        ids = args.session or ledger.session_ids()
        bad = 0
        for sid in ids:
            rep = ledger.audit(sid)
            if rep.clean and not rep.overdue:
                out.print(f"{sid}: clean")
            else:
                bad += 1
                out.print(
                    f"{sid}: [red]{'; '.join(rep.problems) or 'overdue reservations'}[/]"
                    f" overdue={list(rep.overdue)}"
                )
        out.print(f"{len(ids)} session(s) audited, {bad} with violations")
        return EXIT_VIOLATION if bad else EXIT_OK


def cmd_worker(args: argparse.Namespace, out: Console) -> int:
    import logging
    import signal
    import threading

    from prometheus_client import start_http_server

    from ledger.client import Ledger
    from workers.runner import JsonFormatter, Worker, WorkerSettings

    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    overrides: dict[str, object] = {}
    for name in ("compactor", "consumer", "metrics_port", "claim_idle_ms", "max_deliveries"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.interval is not None:
        overrides["sweep_interval"] = args.interval
    wsettings = WorkerSettings(**overrides)  # type: ignore[arg-type]
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    with Ledger.from_settings(_settings(args)) as ledger:
        worker = Worker(ledger, wsettings)
        if wsettings.metrics_port:
            start_http_server(wsettings.metrics_port, registry=worker.metrics.registry)
        worker.run(stop, once=args.once)
        if args.once:
            worker.sweep()
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ledger", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", help="Redis URL (default: LEDGER_REDIS_URL or embedded://)")
    p.add_argument("--prefix", help="key prefix (default: LEDGER_PREFIX or 'ledger')")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="several workers sharing one session budget")
    d.add_argument("--workers", type=int, default=6)
    d.add_argument("--turns", type=int, default=25)
    d.add_argument("--seed", type=int, default=7)
    d.set_defaults(func=cmd_demo)
    a = sub.add_parser("audit", help="prove counters equal items (exit 1 on any violation)")
    a.add_argument("session", nargs="*", help="session ids (default: every session)")
    a.set_defaults(func=cmd_audit)
    w = sub.add_parser(
        "worker",
        help="background worker: compaction and hard-reset jobs, lease expiry",
        description="Consume the partitions' job streams (consumer group), take over jobs of "
        "dead workers, release expired reservations. Options also read LEDGER_WORKER_* "
        "environment variables. Stops cleanly on SIGTERM/SIGINT.",
    )
    w.add_argument("--interval", type=float, help="seconds between lease sweeps (default 1)")
    w.add_argument("--once", action="store_true", help="one pass over every partition, then exit")
    w.add_argument("--compactor", help="import path 'module:attr' (default the simulated one)")
    w.add_argument("--consumer", help="consumer name in the group (default host-pid)")
    w.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    w.add_argument("--claim-idle-ms", type=int, help="take over jobs idle this long")
    w.add_argument("--max-deliveries", type=int, help="dead-letter a job after this many")
    w.set_defaults(func=cmd_worker)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Console()
    err = Console(stderr=True)
    try:
        return int(args.func(args, out))
    except (ConfigurationError, InvalidArgument, ValueError) as exc:
        err.print(f"ledger: {exc}")
        return EXIT_USAGE
    except BackendUnavailable as exc:
        err.print(f"ledger: {exc}")
        return EXIT_UNAVAILABLE
    except LedgerError as exc:
        err.print(f"ledger: {exc}")
        return EXIT_VIOLATION


if __name__ == "__main__":
    sys.exit(main())
