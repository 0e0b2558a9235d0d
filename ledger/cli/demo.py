"""``ledger demo``: the fleet simulator (``ledger.fleet``) run and its report printed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from ledger.cli.common import EXIT_OK, EXIT_VIOLATION, _embedded, _settings
from ledger.extras import need

if TYPE_CHECKING:
    from rich.console import Console


def cmd_demo(args: argparse.Namespace, out: Console) -> int:
    import json
    import logging
    import textwrap

    settings = _settings(args)
    if settings.redis_url is None:  # the demo alone runs in-process when no URL is set
        settings = settings.model_copy(update={"redis_url": "embedded://"})
    # The demo's extra is named before anything runs, not one missing module at a time.
    modules = ["prometheus_client"]  # the background worker the demo runs
    if _embedded(settings):
        modules += ["fakeredis", "lupa"]
    for module in modules:
        need(module, "demo", "ledger demo")
    if args.plot:
        need("matplotlib", "plot", "ledger demo --plot")

    from rich.console import Console
    from rich.progress import Progress

    from ledger.fleet import report as fleet_report
    from ledger.fleet.run import LARGE_SESSIONS, FleetConfig, run, stages

    logging.getLogger("ledger.worker").setLevel(logging.ERROR)
    sessions = args.sessions or (LARGE_SESSIONS if args.large else FleetConfig.sessions)
    config = FleetConfig(
        sessions=sessions,
        workers=args.workers,
        max_turns=args.max_turns,
        seed=args.seed,
        only=frozenset(args.only) if args.only else None,
        without=args.without,
        paced=args.paced,
    )
    if not args.json:
        out.print(
            "[bold]ledger demo[/]: each incident's scenario under its naive arbiter, under "
            + (
                f"the ledger without {config.without}"
                if config.without
                else "the ledger and under the ledger without its rule"
            )
            + f", against [cyan]{settings.redis_url}[/], seed {config.seed}; scenario 001 on "
            f"{config.sessions} agent sessions (median 40 turns, capped at {config.max_turns}; "
            f"and {config.tail} more beyond turn 120"
            f"{', human-paced' if config.paced else ', autonomous'}) and {config.workers} workers"
        )
    # progress on stderr for every stage, --json included (stdout holds the JSON alone):
    # a bar on a terminal, else a line each tenth of a stage (a log, a CI job)
    err = Console(stderr=True)
    if err.is_terminal:
        with Progress(console=err, transient=True) as bar:
            tasks = {name: bar.add_task(name, total=n) for name, n in stages(config).items()}
            res = run(settings, config, progress=lambda name, n: bar.advance(tasks[name], n))
    else:
        res = run(settings, config, progress=_progress_lines(stages(config), sys.stderr))
    summary = fleet_report.summarize(res)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    elif out.width >= WIDE:
        out.print(fleet_report.table(summary))
        out.print(fleet_report.footer(summary))
    else:  # a narrow terminal: blocks wrapped at spaces, no number split across lines
        out.print(fleet_report.narrow(summary, out.width), markup=False, highlight=False)
        for line in fleet_report.footer(summary).splitlines():
            wrapped = textwrap.fill(line, out.width, break_long_words=False, break_on_hyphens=False)
            out.print(wrapped, markup=False, highlight=False)
    if args.plot:
        fleet_report.plot(summary, args.plot)
        if not args.json:
            out.print(f"plot written to {args.plot}")
    clean = res.audits_clean == res.audits_total and res.over_allocations == 0
    checks_pass = all(c["pass"] for c in summary["acceptance"].values())
    return EXIT_OK if clean and checks_pass else EXIT_VIOLATION


def _progress_lines(totals: dict[str, int], stream: TextIO) -> Callable[[str, int], None]:
    """A progress callback for a stream that is not a terminal: one line (stage, steps
    done of its total, seconds since the start) at each tenth of a stage and at its end."""
    import time

    done = dict.fromkeys(totals, 0)
    t0 = time.monotonic()

    def step(name: str, n: int) -> None:
        before, total = done[name], totals[name]
        done[name] = before + n
        if done[name] * 10 // total > before * 10 // total or done[name] >= total:
            print(
                f"ledger demo: {name} {done[name]}/{total} ({time.monotonic() - t0:.0f} s)",
                file=stream,
                flush=True,
            )

    return step


WIDE = 140  # the demo's table needs this many columns; narrower terminals get blocks
