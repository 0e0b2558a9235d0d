"""The ``ledger`` command: ``demo``, ``inspect``, ``scope``, ``top``, ``audit``, ``dead``,
``worker``, ``scripts``.

Exit codes: 0 success; 1 an audit found violations or a damaged session, the demo's
checks failed, or the ledger refused the request (an unknown session or dead letter);
2 bad usage or configuration (among them: no Redis URL for worker, audit, inspect or top,
a worker with no compactor named, or whose compactor cannot be imported or fails its
check); 3 Redis unavailable.

Only ``demo`` runs in-process (``embedded://``) when no URL is set; the other commands
need ``--url`` or ``LEDGER_REDIS_URL`` (``embedded://`` only when asked for by name).

Extras (ledger/extras.py): ``demo`` needs ``redis-token-ledger[demo]``; ``top``,
``inspect``, ``scope``, ``audit`` and ``dead`` need ``[cli]``; ``worker`` needs ``[worker]``;
``scripts`` none.
A missing one is a usage error (exit 2) whose message is the line that installs it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ledger.cli.common import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, EXIT_VIOLATION
from ledger.cli.demo import WIDE, cmd_demo
from ledger.cli.demo import _progress_lines as _progress_lines
from ledger.cli.inspection import cmd_inspect, cmd_scope, inspect_tenant, scope_json, scope_table
from ledger.cli.ops import cmd_audit, cmd_dead, cmd_scripts
from ledger.cli.top import (
    TopView,
    cmd_top,
    cut_end,
    cut_middle,
    distinct_cuts,
    one_line,
    wait_for_key,
)
from ledger.cli.worker import cmd_worker
from ledger.errors import (
    BackendUnavailable,
    ConfigurationError,
    DamagedSession,
    InvalidArgument,
    LedgerError,
)
from ledger.extras import need

# The command's names, one module a group of commands (ledger/cli/*.py), here as they
# were when the command was one module: `from ledger import cli; cli.main(...)`.
__all__ = [
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "EXIT_VIOLATION",
    "WIDE",
    "TopView",
    "build_parser",
    "cmd_audit",
    "cmd_dead",
    "cmd_demo",
    "cmd_inspect",
    "cmd_scope",
    "cmd_scripts",
    "cmd_top",
    "cmd_worker",
    "cut_end",
    "cut_middle",
    "distinct_cuts",
    "inspect_tenant",
    "main",
    "one_line",
    "plain",
    "scope_json",
    "scope_table",
    "wait_for_key",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ledger",
        description=plain(__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--url",
        help="Redis URL (default: LEDGER_REDIS_URL; required except for demo, which "
        "defaults to embedded://)",
    )
    p.add_argument("--prefix", help="key prefix (default: LEDGER_PREFIX or 'ledger')")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    # --url and --prefix are taken after the command too (`ledger audit --url ...`)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS, help="Redis URL (as above)")
    common.add_argument("--prefix", default=argparse.SUPPRESS, help="key prefix (as above)")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, **kw: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kw)

    d = add(
        "demo",
        help="a fleet of agent sessions: naive arbiter vs the ledger",
        description="Run each scenario (starvation, compaction-decay, "
        "truncation-loop, fan-out) once under a naive arbiter with the scenario's conditions "
        "and once under the ledger (and its background worker), and compare them with the "
        "figures docs/demo.md states. Embedded: agents are threads in this process; "
        "a Redis URL: OS processes.",
    )
    d.add_argument(
        "--sessions",
        type=int,
        help="scenario 001's fleet (default 48; --large: 330), and 30 more beyond turn 120",
    )
    d.add_argument(
        "--large", action="store_true", help="the large fleet for scenario 001 (330 sessions)"
    )
    d.add_argument(
        "--workers",
        type=int,
        default=4,
        help="agent processes on a Redis URL (default 4; on embedded, scenario 001's sessions "
        "run one after another on a stepped clock)",
    )
    d.add_argument("--max-turns", type=int, default=130, help="cap on session length")
    d.add_argument(
        "--paced",
        action="store_true",
        help="scenario 001's agents human-paced (a user's think time between turns) instead "
        "of autonomous (each turn begins as the last one ends)",
    )
    d.add_argument("--seed", type=int, default=7)
    d.add_argument("--json", action="store_true", help="print the results as JSON")
    d.add_argument(
        "--only",
        action="append",
        choices=("000", "001", "002", "004"),
        metavar="SCENARIO",
        help="run this scenario only (000, 001, 002, 004; repeatable)",
    )
    d.add_argument(
        "--without",
        choices=("compaction-credit", "working-memory", "spill", "amplification"),
        metavar="RULE",
        help="run the ledger column without this rule (compaction-credit, working-memory, "
        "spill, amplification): its scenario's checks then fail and the demo exits 1",
    )
    d.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw scenario 001's retrieval admission and compaction interval per turn "
        '(needs matplotlib: pip install "redis-token-ledger[plot]")',
    )
    d.set_defaults(func=cmd_demo)
    a = add(
        "audit",
        help="prove counters equal items (exit 1 on any violation)",
        description="Check every session's counters (or the named sessions') against its "
        "items and reservations, in batches. Prints the Redis settings' warnings, each "
        "session with violations, each damaged session (named with what is wrong, not "
        "audited), each named id that does not exist, overdue leases, and a summary "
        "line. Exit 1 on a violation, a damaged session, a missing named id or an id under two "
        "partitions (with --strict also on overdue leases and Redis warnings), 3 when "
        "Redis is unavailable.",
    )
    a.add_argument("session", nargs="*", help="session ids (default: every session)")
    a.add_argument("--json", action="store_true", help="print the result as one JSON object")
    a.add_argument(
        "--strict",
        action="store_true",
        help="also fail on overdue leases and on the Redis settings' warnings",
    )
    a.add_argument("--verbose", "-v", action="store_true", help="also list each clean session")
    a.set_defaults(func=cmd_audit)
    i = add(
        "inspect",
        help="one session: allocations, items, reservations, journal; or a tenant (--tenant)",
        description="A session (allocations, items, reservations, outcomes kept, dead "
        "letters), or with --tenant a tenant: each of its budget scopes' window, ceilings, "
        "charged, held and remaining per quantity, refusals, its open holds and its sessions.",
    )
    i.add_argument("session", nargs="?", help="the session id (or --tenant)")
    i.add_argument("--tenant", metavar="TENANT", help="inspect a tenant's budget scopes instead")
    i.add_argument("--json", action="store_true", help="with --tenant: one JSON object")
    i.add_argument(
        "--items",
        type=int,
        default=20,
        help="newest items shown, newest first (default 20); with --tenant, sessions named",
    )
    i.add_argument("--journal", type=int, default=10, help="journal entries shown (default 10)")
    i.add_argument(
        "--op",
        action="append",
        metavar="OP_ID",
        help="show the outcome kept for this op id (the journal shows SHA-1 keys, not op "
        "ids); repeatable",
    )
    i.set_defaults(func=cmd_inspect)
    sc = add(
        "scope",
        help="a budget scope (a tenant, or <tenant>/<name>): ceilings, charged, remaining",
        description="A budget scope's current window (docs/ceilings.md): per quantity what "
        "is charged (open holds and billed usage), held and left under its ceiling; its "
        "refusals; what settles billed past their holds; the billed usage of each bucket kept.",
    )
    sc.add_argument("scope", help="the tenant, or <tenant>/<name>")
    sc.add_argument("--json", action="store_true", help="print the scope as one JSON object")
    sc.set_defaults(func=cmd_scope)
    tp = add("top", help="live view of the busiest sessions and the indicators (q quits)")
    tp.add_argument(
        "--limit", type=int, help="sessions shown (default: as many as the terminal's height fits)"
    )
    tp.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    tp.add_argument("--once", action="store_true", help="print one frame and exit")
    tp.add_argument(
        "--sort",
        choices=("util", "free", "refused", "drift", "turn"),
        default="util",
        help="rank sessions by utilization (default), least free room, refusals, |drift| or turn",
    )
    tp.add_argument("--match", metavar="GLOB", help="only sessions whose id matches, e.g. 'acme/*'")
    tp.add_argument(
        "--tenant",
        metavar="TENANT",
        help="only the tenant's sessions (@TENANT/...), its budget scopes' lines above them",
    )
    tp.set_defaults(func=cmd_top)
    dl = add(
        "dead",
        help="jobs the worker gave up on: list, show, replay, purge",
        description="Each partition keeps the jobs the worker dead-lettered (after "
        "max_deliveries attempts) in <prefix>:{p<N>}:dead, at most dead_letter_max each. "
        "list shows them (all, or those named) as p<N>:<entry id> with their age (since "
        "they were dead-lettered, on Redis's clock), kind, session, why and the last "
        "error; show prints the named ones (or --all) whole, every field; replay puts the "
        "named ones (or --all) back on their job streams as new jobs, fenced by the "
        "session's epoch like any job; purge deletes them.",
    )
    dl.add_argument("action", choices=("list", "show", "replay", "purge"))
    dl.add_argument("refs", nargs="*", metavar="p<N>:<ID>", help="dead letters (from list)")
    dl.add_argument("--all", action="store_true", help="show, replay or purge every dead letter")
    dl.add_argument("--limit", type=int, default=100, help="letters listed (default 100)")
    dl.add_argument("--json", action="store_true", help="list as one JSON object")
    dl.set_defaults(func=cmd_dead)
    sc = add(
        "scripts",
        help="write every Lua script as the clients send it to DIR/<name>.lua",
        description="Each operation's full text (the _common.lua definitions it uses, then "
        "its own file), for a client in another language to send with EVAL or SCRIPT LOAD "
        "(docs/protocol.md). Prints '<sha1> <path>' per script. Needs no Redis.",
    )
    sc.add_argument("dir", type=Path, metavar="DIR")
    sc.set_defaults(func=cmd_scripts)
    w = add(
        "worker",
        help="background worker: compaction and hard-reset jobs, lease expiry",
        description="Consume the partitions' job streams (consumer group), take over jobs of "
        "dead workers, release expired reservations. Options also read LEDGER_WORKER_* "
        "environment variables. Stops cleanly on SIGTERM/SIGINT.",
    )
    w.add_argument("--interval", type=float, help="seconds between lease sweeps (default 1)")
    w.add_argument("--once", action="store_true", help="one pass over every partition, then exit")
    w.add_argument(
        "--compactor",
        help="import path 'module:attr' of the compactor for worker-owned sessions, or "
        "'none' (required, or LEDGER_WORKER_COMPACTOR)",
    )
    w.add_argument("--max-in-flight", type=int, help="compactions at once (default 16)")
    w.add_argument("--consumer", help="consumer name in the group (default host-pid)")
    w.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    w.add_argument(
        "--metrics-host",
        help="address the metrics endpoint listens on (default 0.0.0.0; 127.0.0.1: this host)",
    )
    w.add_argument(
        "--drain-seconds",
        type=float,
        help="at SIGTERM, how long the jobs running get to end (default 25, at most 30)",
    )
    w.add_argument("--claim-idle-ms", type=int, help="take over jobs idle this long")
    w.add_argument("--max-deliveries", type=int, help="dead-letter a job after this many")
    w.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        help="the lowest level logged (default info; LEDGER_WORKER_LOG_LEVEL)",
    )
    w.set_defaults(func=cmd_worker)
    return p


def plain(doc: str) -> str:
    """A docstring as ``--help`` prints it: without reStructuredText's literal quotes
    (double backticks), which a terminal shows as they are typed."""
    return doc.replace("``", "")


def _version() -> str:
    """The release and the protocol version it speaks (docs/operations.md#upgrades)."""
    from ledger import __version__
    from ledger.protocol import VERSION

    return f"{__version__} (protocol {VERSION})"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except BrokenPipeError:
        # the reader went away (`ledger scripts DIR | head -3`): what it read was whole;
        # stdout is pointed at /dev/null so that the interpreter's last flush is quiet
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command == "worker":
            return cmd_worker(args)
        if args.command == "scripts":
            code = cmd_scripts(args)
            sys.stdout.flush()
            return code
        extra = "demo" if args.command == "demo" else "cli"
        console = need("rich.console", extra, f"ledger {args.command}").Console()
        code = int(args.func(args, console))
        sys.stdout.flush()  # a closed pipe is met here, inside main, not at exit
        return code
    except DamagedSession as exc:  # the session is damaged, not the command line
        return _fail(exc, EXIT_VIOLATION)
    except (ConfigurationError, InvalidArgument, ValueError) as exc:
        return _fail(exc, EXIT_USAGE)
    except BackendUnavailable as exc:
        return _fail(exc, EXIT_UNAVAILABLE)
    except LedgerError as exc:
        return _fail(exc, EXIT_VIOLATION)


def _fail(exc: Exception, code: int) -> int:
    # Plain text: rich would read the "[demo]" of an install line as markup and drop it.
    print(f"ledger: {exc}", file=sys.stderr)
    return code
