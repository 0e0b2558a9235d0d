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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TextIO

from ledger import schema
from ledger.errors import (
    BackendUnavailable,
    ConfigurationError,
    DamagedSession,
    InvalidArgument,
    LedgerError,
    UnknownSession,
)
from ledger.extras import need
from ledger.settings import LedgerSettings, require_url

if TYPE_CHECKING:
    from rich.console import Console, Group
    from rich.table import Table

    from ledger.client import Ledger
    from ledger.models import ScopeUsage, Snapshot

EXIT_OK, EXIT_VIOLATION, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


def _settings(args: argparse.Namespace) -> LedgerSettings:
    overrides: dict[str, str] = {}
    if args.url:
        overrides["redis_url"] = args.url
    if args.prefix:
        overrides["prefix"] = args.prefix
    return LedgerSettings(**overrides)


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
            f"and {config.tail} more beyond turn 120) and {config.workers} workers"
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


def _embedded(settings: LedgerSettings) -> bool:
    from ledger.backends import parse_url

    return parse_url(require_url(settings)).kind == "embedded"


def cmd_audit(args: argparse.Namespace, out: Console) -> int:
    """Every session (or those named): counters against items. The Redis settings'
    warnings first, then each session with violations (and, with --verbose, each clean
    one), then one summary line; --json prints the same as one object. A damaged session
    (its hash not as the scripts write it) is named with what is wrong and gets no
    verdict; every other session still gets its own. Exit 1 on any violation, a damaged
    session, an id under two partitions, or an id asked for that does not exist; with
    --strict also on overdue leases and on the Redis settings' warnings."""
    import json

    from rich.markup import escape

    from ledger import health
    from ledger.client import Ledger
    from ledger.errors import translated
    from ledger.views import Damaged, audits, dead_letters, placements

    with Ledger.from_settings(_settings(args)) as ledger:
        with translated():  # Redis gone meanwhile: BackendUnavailable, exit 3
            warnings = health.describe(health.check(ledger.client, ledger.settings.redis_url))
        where = placements(ledger, set(args.session) if args.session else None)
        ids = list(dict.fromkeys(args.session)) if args.session else sorted(where)
        # An id under two partitions: clients with different partition counts opened it,
        # and each sees only its own copy. Reported whatever the audit of this key
        # space's copy (which may be neither of them) says.
        split = {sid: ps for sid, ps in where.items() if len(ps) > 1}
        violations: dict[str, list[str]] = {}
        damaged: dict[str, list[str]] = {}
        overdue: dict[str, list[str]] = {}
        clean: list[str] = []
        missing: list[str] = []
        for sid, rep in audits(ledger, ids):
            if isinstance(rep, UnknownSession):
                if args.session and sid not in split:  # asked for by name: named, not fatal
                    missing.append(sid)
                continue  # closed (a tombstone) or expired since it was listed
            if isinstance(rep, Damaged):  # named, not judged; the others still are
                damaged[sid] = list(rep.problems)
                continue
            if rep.overdue:  # not a violation: the worker's sweep has not released it yet
                overdue[sid] = list(rep.overdue)
            if rep.clean:
                clean.append(sid)
            else:
                violations[sid] = list(rep.problems)
        # A session one of whose jobs was dead-lettered: named with the letters' refs (the
        # worker counted a dead compaction as a failed one; `ledger dead show` tells why).
        asked = set(ids)
        held: dict[str, list[str]] = {}
        for letter in dead_letters(ledger, limit=10_000)[1]:
            sid = letter.fields.get("session", "")
            if sid in asked:
                held.setdefault(sid, []).append(letter.ref)
    audited = len(clean) + len(violations)
    failed = bool(violations or damaged or split or missing) or (
        args.strict and bool(overdue or warnings)
    )
    if args.json:
        print(
            json.dumps(
                {
                    "audited": audited,
                    "clean": len(clean),
                    "violations": violations,
                    "damaged": damaged,
                    "dead_letters": dict(sorted(held.items())),
                    "overdue": overdue,
                    "missing": missing,
                    "split": {sid: ps for sid, ps in sorted(split.items())},
                    "warnings": warnings,
                    "strict": args.strict,
                    "ok": not failed,
                },
                indent=2,
            )
        )
        return EXIT_VIOLATION if failed else EXIT_OK
    for line in warnings:
        out.print(f"[yellow]warning:[/] {escape(line)}", soft_wrap=True)
    for sid, ps in sorted(split.items()):
        keys = ", ".join(f"{ledger.keyspace.tag(p)}:s:{sid}" for p in ps)
        out.print(
            f"{escape(sid)}: [red]under {len(ps)} partitions "
            f"({', '.join(f'p{p}' for p in ps)}): {escape(keys)}[/]; clients with "
            f"different partition counts opened it (this one: "
            f"{ledger.keyspace.partitions}, p{ledger.keyspace.partition_of(sid)})",
            highlight=False,
            soft_wrap=True,
        )
    for sid in missing:
        out.print(f"{escape(sid)}: [red]no such session[/] (never opened, deleted or expired)")
    for sid, problems in violations.items():
        out.print(f"{escape(sid)}: [red]{escape('; '.join(problems))}[/]", soft_wrap=True)
    for sid, problems in damaged.items():
        out.print(
            f"{escape(sid)}: [bold red]{escape('; '.join(problems))}[/]; not audited (the "
            "hash was written by something other than the ledger's scripts)",
            soft_wrap=True,
        )
    for sid, refs in sorted(held.items()):
        out.print(
            f"{escape(sid)}: [yellow]a job dead-lettered[/] ({escape(', '.join(refs))}); "
            "see `ledger dead show`",
            soft_wrap=True,
        )
    if args.verbose:  # written in bulk: one rich print per line is slow at scale
        out.out("".join(f"{sid}: clean\n" for sid in clean if sid not in split), end="")
    for sid, late in overdue.items():
        out.print(
            f"{escape(sid)}: {len(late)} lease(s) past their deadline, not yet released by "
            f"the worker's sweep: {escape(', '.join(late))}",
            soft_wrap=True,
        )
    more = [
        f"{n} {what}"
        for n, what in (
            (len(damaged), "damaged (not audited)"),
            (len(missing), "missing"),
            (len(split), "under two partitions"),
            (len(overdue), "with overdue leases"),
            (len(warnings), "Redis setting warning(s)"),
        )
        if n
    ]
    out.print(
        f"{audited} session(s) audited: {len(clean)} clean, {len(violations)} with "
        f"violations{''.join(', ' + m for m in more)}" + ("; --strict" if args.strict else ""),
        highlight=False,
        soft_wrap=True,
    )
    return EXIT_VIOLATION if failed else EXIT_OK


def cmd_dead(args: argparse.Namespace, out: Console) -> int:
    """The jobs the worker gave up on: list them (all, or those named), show them whole,
    or replay or purge some (or --all). Ages are measured on Redis's clock."""
    import json

    from rich.markup import escape

    from ledger.client import Ledger
    from ledger.views import dead_letters, purge_dead, redis_now_ms, replay_dead, take_dead

    with Ledger.from_settings(_settings(args)) as ledger:
        if args.action in ("list", "show"):
            if args.action == "show" and not args.refs and not args.all:
                raise InvalidArgument("ledger dead show needs letters (p<N>:<id>) or --all")
            if args.refs:
                letters = take_dead(ledger, args.refs)
                depths: dict[int, int] = {}
            else:
                depths, letters = dead_letters(ledger, args.limit)
            now = redis_now_ms(ledger)
            if args.json:
                rows = [
                    {"ref": d.ref, "age_s": (now - d.dead_since_ms) // 1000, **d.fields}
                    for d in letters
                ]
                print(json.dumps({"depths": depths, "letters": rows}, indent=2))
                return EXIT_OK
            for d in letters:
                e = schema.DeadLetterEntry.from_fields(d.fields)
                age = _age(now - d.dead_since_ms)
                if args.action == "show":  # every field, the error whole
                    out.print(f"[bold]{escape(d.ref)}[/]  dead for {age}", highlight=False)
                    for k, v in sorted(d.fields.items()):
                        out.print(f"  {escape(k)}: {escape(v)}", soft_wrap=True, highlight=False)
                    continue
                out.print(
                    f"{escape(d.ref)} {age:>4} {escape(e.kind)} session "
                    f"{escape(e.session)}: {escape(e.why)}; {escape(e.error[:200])}",
                    soft_wrap=True,
                    highlight=False,
                )
            if args.action == "list" and not args.refs:
                total = sum(depths.values())
                out.print(
                    f"{total} dead letter(s) in {len(depths)} partition(s)"
                    + (f", {len(letters)} shown" if len(letters) < total else ""),
                    highlight=False,
                )
            return EXIT_OK
        if not args.refs and not args.all:
            raise InvalidArgument(f"ledger dead {args.action} needs letters (p<N>:<id>) or --all")
        refs = None if args.all else args.refs
        if args.action == "replay":
            new = replay_dead(ledger, refs)
            out.print(f"{len(new)} dead letter(s) put back on their job streams", highlight=False)
        else:
            n = purge_dead(ledger, refs)
            out.print(f"{n} dead letter(s) deleted", highlight=False)
    return EXIT_OK


def cmd_scripts(args: argparse.Namespace) -> int:
    """Plain output and no extra: a client in another language needs only the package."""
    from ledger import scripts

    for path in scripts.dump(args.dir):
        print(scripts.sha(path.stem), path)
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace, out: Console) -> int:
    from rich.markup import escape
    from rich.table import Table

    from ledger.client import Ledger
    from ledger.views import session_dead_letters, stored_outcome, view

    if (args.session is None) == (args.tenant is None):
        raise InvalidArgument("inspect takes a session id or --tenant TENANT (one of them)")
    if args.tenant is not None:
        return inspect_tenant(args, out)
    if args.json:
        raise InvalidArgument("--json is for --tenant (a session: ledger audit SESSION --json)")
    with Ledger.from_settings(_settings(args)) as ledger:
        v = view(ledger, args.session, journal=args.journal)
        ops = {op: stored_outcome(ledger, args.session, op) for op in args.op or ()}
        letters = session_dead_letters(ledger, args.session)
    snap = v.snapshot
    out.print(
        f"[bold]{v.session_id}[/]  epoch {snap.epoch}  turn {snap.turn}  regime "
        f"[bold]{v.regime}[/]  utilization {snap.utilization:.2f}  free {snap.free}  "
        f"residual working memory {snap.residual_working_memory}"
        + ("  [yellow]compaction pending[/]" if snap.compaction_pending else "")
    )
    negative = [
        f"{name} {value}"
        for name, value in (("free", snap.free), ("residual", snap.residual_working_memory))
        if value < 0
    ]
    if negative:  # the scripts never leave either below 0: the stored state is damaged
        out.print(
            f"[bold red]DAMAGED: {', '.join(negative)} below 0: the stored allocations "
            "exceed the window (ledger audit names what disagrees)[/]"
        )
    for d in letters:  # jobs of this session the worker gave up on, newest first
        epoch = d.fields.get("epoch", "?")
        held = epoch == str(snap.epoch)  # of this epoch: its failed state is this one's
        out.print(
            ("[bold red]HELD BY A DEAD LETTER[/] " if held else "dead letter ")
            + f"{escape(d.ref)}: {escape(d.fields.get('kind', '?'))} job of epoch {escape(epoch)}, "
            + escape(d.fields.get("why", ""))
            + (f"; last error {escape(d.fields.get('error', ''))}" if d.fields.get("error") else "")
            + ("  (ledger dead list / replay / purge)" if held else "")
        )
    tol = "not judged" if snap.framing_tolerance is None else str(snap.framing_tolerance)
    out.print(
        f"last real prompt {snap.last_prompt}  drift {snap.drift:+d} (prompt - occupancy; "
        f"tolerance {tol})"
        + (
            "  [bold red]DRIFT FLAGGED: reconcile the ledger to the prompt[/]"
            if snap.drift_flagged
            else ""
        )
    )
    t = Table(title="allocations")
    for col in ("consumer", "items", "tokens held", "reserved"):
        t.add_column(col, justify="right")
    for c in snap.used:
        t.add_row(c.value, str(snap.items[c]), str(snap.used[c]), str(snap.reserved[c]))
    t.add_row("system prompt + framing", "", str(snap.system_prompt + snap.tool_framing), "")
    t.add_row("output reserve", "", str(snap.output_reserve), "")
    out.print(t)
    newest = v.items[::-1][: max(args.items, 0)]  # v.items is oldest first
    items = Table(title=f"items ({len(v.items)}; the newest {len(newest)}, newest first)")
    for col in ("consumer", "id", "tokens", "turn", "priority"):
        items.add_column(col)
    for it in newest:
        items.add_row(it.consumer.value, it.id, str(it.tokens), str(it.turn), str(it.priority))
    out.print(items)
    if v.reservations:
        res = Table(title="open reservations")
        for col in ("id", "consumer", "tokens", "deadline (ms)", "overdue"):
            res.add_column(col)
        for rid, consumer, tokens, deadline in v.reservations:
            res.add_row(
                rid,
                consumer.value,
                str(tokens),
                str(deadline),
                "yes" if deadline < snap.now_ms else "",
            )
        out.print(res)
    j = Table(title="outcomes kept for retries (current generation first)")
    for col in ("op key (SHA-1 of the op id)", "outcome"):
        j.add_column(col)
    for e in v.journal:
        j.add_row(e.op_key, e.reply)
    out.print(j)
    for op, found in ops.items():
        where = "not kept" if found is None else f"{found[0]} generation: {found[1]}"
        out.print(f"op {escape(op)}: {escape(where)}", soft_wrap=True)
    if v.counters:
        out.print("counters: " + ", ".join(f"{k}={val}" for k, val in sorted(v.counters.items())))
    return EXIT_VIOLATION if negative else EXIT_OK


def scope_json(u: ScopeUsage) -> dict[str, Any]:
    """A budget scope's window as one JSON object (``ledger scope --json``, and each
    scope of ``ledger inspect --tenant --json``)."""
    return {
        "scope": u.scope,
        "now_ms": u.now_ms,
        "window_ms": u.window_ms,
        "bucket_ms": u.bucket_ms,
        "ceilings": dict(u.ceilings),
        "charged": dict(u.charged),
        "held": dict(u.held),
        "remaining": dict(u.remaining),
        "open_holds": u.open_holds,
        "refused": u.refused,
        "over": u.over,
        "over_money": u.over_money,
        "buckets": {str(b): dict(v) for b, v in u.buckets.items()},
    }


def scope_table(u: ScopeUsage, title: str | None = None) -> Table:
    """Per quantity: the ceiling, what the window charged, of which held, what is left."""
    from rich.table import Table

    t = Table("quantity", "ceiling", "charged", "of which held", "remaining", title=title)
    for c in t.columns[1:]:
        c.justify, c.no_wrap = "right", True
    for q in ("input", "output", "cached_input", "money"):
        left = u.remaining.get(q)
        cap = u.ceilings.get(q)
        t.add_row(
            "money (micro-cents)" if q == "money" else q,
            "-" if cap is None else str(cap),
            str(u.charged[q]),
            str(u.held[q]),
            "-" if left is None else str(left),
        )
    if "tokens" in u.remaining:
        t.add_row("tokens (counted)", str(u.ceilings["tokens"]), "", "", str(u.remaining["tokens"]))
    return t


def _window(u: ScopeUsage) -> str:
    kind = "fixed" if u.window_ms == u.bucket_ms else f"rolling, buckets of {u.bucket_ms} ms"
    return f"window {u.window_ms} ms ({kind})"


def inspect_tenant(args: argparse.Namespace, out: Console) -> int:
    """``ledger inspect --tenant T``: each scope of the tenant (the tenant's own first),
    its window, ceilings, charged, held and remaining per quantity, refusals and what was
    billed past holds; the open holds, soonest deadline first; the tenant's sessions."""
    import json

    from rich.markup import escape
    from rich.table import Table

    from ledger.client import Ledger
    from ledger.errors import UnknownScope
    from ledger.views import tenant_view

    with Ledger.from_settings(_settings(args)) as ledger:
        v = tenant_view(ledger, args.tenant)
    if not v.scopes:
        raise UnknownScope(
            f"no budget scope set for tenant {args.tenant!r} ({len(v.sessions)} sessions "
            "named @<tenant>/...): ledger scope, set_scope"
        )
    if args.json:
        body = {
            "tenant": v.tenant,
            "now_ms": v.now_ms,
            "scopes": [scope_json(u) for u in v.scopes],
            "holds": [
                {
                    "scope": h.scope,
                    "session": h.session_id,
                    "reservation": h.reservation,
                    "deadline_ms": h.deadline_ms,
                    "held": dict(h.held),
                    "overdue": h.overdue,
                }
                for h in v.holds
            ],
            "sessions": v.sessions,
        }
        print(json.dumps(body))
        return EXIT_OK
    out.print(
        f"[bold]tenant {escape(v.tenant)}[/]  {len(v.scopes)} scopes  {len(v.holds)} open holds  "
        f"{len(v.sessions)} sessions  (Redis clock {v.now_ms} ms)"
    )
    for u in v.scopes:
        out.print(
            f"[bold]{escape(u.scope)}[/]  {_window(u)}  open holds {u.open_holds}  "
            f"refused {u.refused}  billed past holds {u.over} tokens, {u.over_money} micro-cents"
        )
        out.print(scope_table(u))
    if v.holds:
        t = Table(title="open holds, soonest deadline first")
        for col in ("scope", "session", "reservation"):
            t.add_column(col, overflow="ellipsis")
        for col in ("input/output/cached", "micro-cents", "deadline in"):
            t.add_column(col, justify="right", no_wrap=True)
        for h in v.holds:
            left = h.deadline_ms - v.now_ms
            t.add_row(
                escape(h.scope),
                escape(h.session_id),
                escape(h.reservation),
                "/".join(str(h.held[q]) for q in ("input", "output", "cached_input")),
                str(h.held["money"]),
                "OVERDUE" if h.overdue else f"{left / 1000:.1f} s",
            )
        out.print(t)
    shown = v.sessions[: max(args.items, 0)]
    more = f" (the first {len(shown)}; --items N)" if len(shown) < len(v.sessions) else ""
    out.print(f"sessions{more}: " + (", ".join(escape(s) for s in shown) or "none"))
    return EXIT_OK


def _age(ms: int) -> str:
    s = max(ms, 0) // 1000
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


class TopView:
    """The frames of ``ledger top``: the busiest sessions, with rates since the
    previous frame (turns and refusals per second; '-' on the first frame). A damaged
    session (a field that holds no number) is a row of its own, flagged DAMAGED, and the
    view keeps running."""

    COLUMNS = (
        "regime",
        "util",
        "free",
        "resid",
        "turn",
        "turn/s",
        "refused",
        "ref/s",
        "drift",
        "age",
        "dead",
    )
    # Below the width every column needs, these go first (in this order): a number is
    # never cut, a column is left out whole.
    DROPPED = ("age", "ref/s", "turn/s", "resid", "drift", "dead", "refused", "turn", "free")
    SCOPE_LINES = 4  # with --tenant: the tenant's scopes, one line each, at most
    SESSION_MIN = 8  # the session column's least width
    CHROME = 6  # lines besides the rows: header, title, column names, rule, footer, slack

    def __init__(
        self,
        limit: int | None,
        sort: str = "util",
        match: str | None = None,
        tenant: str | None = None,
    ) -> None:
        self.limit = limit  # None: as many rows as the height given to each frame fits
        self.sort = sort
        self.match = match
        self.tenant = tenant  # only its sessions, its scopes above them
        self.prev: dict[str, tuple[int, int, int]] = {}  # sid -> now_ms, turn, refusals
        self.natural = 80  # the width of the last frame made with width=None

    def rows(self, height: int) -> int:
        return self.limit or max(5, height - self.CHROME)

    def frame(
        self, ledger: Ledger, width: int | None = 80, live: bool = False, height: int = 24
    ) -> Group:
        """One frame, ``width`` columns wide at most (None: as wide as its content, for
        output that is not a terminal) and, without a limit, ``height`` lines high."""
        import time

        from ledger.views import busiest, dead_lettered, fleet_status, listed

        ids = listed(ledger)  # one SCAN a frame: the header's count and the ranking
        scopes = self._scope_lines(ledger) if self.tenant is not None else []
        if self.tenant is not None:
            ids = [sid for sid in ids if sid.startswith(f"@{self.tenant}/")]
        damaged: dict[str, str] = {}
        limit = self.rows(height) - (len(scopes) if self.limit is None else 0)
        rows, totals = busiest(ledger, limit, self.sort, self.match, ids, damaged)
        fleet = fleet_status(ledger)
        dead = dead_lettered(ledger) if fleet.dead else {}
        cells = [(sid, ["DAMAGED"] + ["-"] * (len(self.COLUMNS) - 1)) for sid in sorted(damaged)]
        cells = (cells + self._cells(rows, dead))[:limit]
        if self.tenant is not None:  # the header names the tenant: its ids without it
            cells = [(sid.removeprefix(f"@{self.tenant}/"), row) for sid, row in cells]
        shown = "" if self.match is None else f" matching {self.match}"
        whose = "" if self.tenant is None else f" of tenant {self.tenant}"
        header = (
            f"ledger top {time.strftime('%H:%M:%S')}: {len(ids)} sessions{whose}"
            + (f" ({len(damaged)} DAMAGED)" if damaged else "")
            + f"; jobs lag {fleet.lag}, pending {fleet.pending}; dead letters {fleet.dead}"
            + ("; no worker has run" if fleet.groups == 0 else "")
        )
        title = f"top {len(rows)}{shown} by {self.sort}" + (
            "" if self.tenant is None else f" (session ids after @{self.tenant}/)"
        )
        return self._render(header, title, cells, totals, width, live, bool(damaged), scopes)

    def _scope_lines(self, ledger: Ledger) -> list[str]:
        """The tenant's scopes (its own first), one line each: what is left of each
        ceiling set (money in cents), refusals, open holds."""
        from ledger.scope_reads import scope_names, scope_usages

        assert self.tenant is not None
        names = scope_names(ledger, self.tenant)
        names.sort(key=lambda n: (n != self.tenant, n))
        lines = []
        for u in scope_usages(ledger, names[: self.SCOPE_LINES]):
            left = [
                f"{q} {u.remaining[q] / 1e6:.2f}/{u.ceilings[q] / 1e6:.2f} cents"
                if q == "money"
                else f"{q} {u.remaining[q]}/{u.ceilings[q]}"
                for q in sorted(u.remaining)
            ]
            lines.append(
                f"{u.scope}: left {', '.join(left) or 'no ceiling'}; refused {u.refused}; "
                f"holds {u.open_holds}"
            )
        if len(names) > self.SCOPE_LINES:
            lines.append(f"+{len(names) - self.SCOPE_LINES} more scopes: ledger inspect --tenant")
        if not names:
            lines.append(f"tenant {self.tenant}: no budget scope set")
        return lines

    def _cells(
        self, rows: list[tuple[str, Snapshot]], dead: dict[str, list[int]] | None = None
    ) -> list[tuple[str, list[str]]]:
        from ledger.views import regime

        out: list[tuple[str, list[str]]] = []
        seen: dict[str, tuple[int, int, int]] = {}
        for sid, snap in rows:
            seen[sid] = (snap.now_ms, snap.turn, snap.refusals)
            turn_rate = ref_rate = "-"
            before = self.prev.get(sid)
            if before and snap.now_ms > before[0]:
                dt = (snap.now_ms - before[0]) / 1000
                turn_rate = f"{(snap.turn - before[1]) / dt:.1f}"
                ref_rate = f"{(snap.refusals - before[2]) / dt:.1f}"
            row = [
                regime(snap, snap.raw.get(schema.WORKING_SET, 0))
                + ("*" if snap.compaction_pending else ""),
                f"{snap.utilization:.2f}",
                str(snap.free),
                str(snap.residual_working_memory),
                str(snap.turn),
                turn_rate,
                str(snap.refusals),
                ref_rate,
                f"{snap.drift:+d}" + ("!" if snap.drift_flagged else ""),
                _age(snap.now_ms - snap.raw.get(schema.INCARNATION, snap.now_ms)),
                self._dead((dead or {}).get(sid, []), snap.epoch),
            ]
            out.append((sid, row))
        self.prev = seen
        return out

    @staticmethod
    def _dead(epochs: list[int], epoch: int) -> str:
        """The dead column: '-', or how many of the session's jobs were dead-lettered,
        '!' when one is of its current epoch (a compaction of this epoch given up on:
        ledger inspect shows it HELD BY A DEAD LETTER)."""
        if not epochs:
            return "-"
        return f"{len(epochs)}" + ("!" if epoch in epochs else "")

    def _render(
        self,
        header: str,
        title: str,
        cells: list[tuple[str, list[str]]],
        totals: dict[str, int],
        width: int | None,
        live: bool,
        damaged: bool = False,
        scopes: Sequence[str] = (),
    ) -> Group:
        from rich import box
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        # Numbers are never cut: each column is as wide as its widest value, and a
        # terminal too narrow for them all loses whole columns (DROPPED). The session id
        # takes what is left and is cut where the ids do not differ.
        widths = {
            col: max([len(col)] + [len(row[i]) for _, row in cells])
            for i, col in enumerate(self.COLUMNS)
        }
        flagged = any(row[-1] != "-" for _, row in cells)
        kept = [c for c in self.COLUMNS if c != "dead" or flagged]  # shown when it flags
        longest = max([len("session")] + [len(sid) for sid, _ in cells])
        legend = (
            "* compaction pending; "
            + ("dead: letters, ! of its epoch; " if flagged else "")
            + ("DAMAGED: ledger inspect <id> names the field; " if damaged else "")
            + "indicators: "
        )
        keys = "; q quits" if live else ""
        indicators = [f"{k}={v}" for k, v in sorted(totals.items()) if v] or ["none"]
        if width is None:  # not a terminal: nothing is cut
            width = longest + sum(widths[c] + 1 for c in kept)
            whole = len(legend) + len(", ".join(indicators)) + len(keys)
            longest_scope = max([len(line) for line in scopes], default=0)
            self.natural = width = max(width, len(header), len(title), whole, longest_scope)
        for col in (c for c in self.DROPPED if c in kept):
            if self.SESSION_MIN + sum(widths[c] + 1 for c in kept) <= width:
                break
            kept.remove(col)
        rest = width - sum(widths[c] + 1 for c in kept)  # one space between columns
        sid_width = max(self.SESSION_MIN, min(longest, rest))
        t = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0))
        t.add_column("session", no_wrap=True, overflow="crop", width=sid_width)
        for col in kept:
            t.add_column(col, justify="right", no_wrap=True, width=widths[col])
        at = [self.COLUMNS.index(c) for c in kept]
        ids = distinct_cuts([sid for sid, _ in cells], sid_width)
        for sid, (_, row) in zip(ids, cells, strict=True):
            t.add_row(sid, *(row[i] for i in at))
        footer = legend + one_line(indicators, width - len(legend) - len(keys))
        return Group(
            Text(cut_end(header, width), no_wrap=True, overflow="crop"),
            *(Text(cut_end(line, width), no_wrap=True, overflow="crop") for line in scopes),
            t,
            Text(footer + keys, no_wrap=True, overflow="crop"),
        )


def one_line(parts: list[str], width: int) -> str:
    """``parts`` joined by ', ' in at most ``width`` characters: those that do not fit
    are left out whole and counted (``+3 more``); never a part cut or a second line."""
    for n in range(len(parts), 0, -1):
        more = f", +{len(parts) - n} more" if n < len(parts) else ""
        text = ", ".join(parts[:n]) + more
        if len(text) <= width:
            return text
    return cut_end(f"+{len(parts)} more", max(width, 0))


def cut_end(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, its end replaced by an ellipsis."""
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def distinct_cuts(ids: list[str], width: int, head: int = 6, tail: int = 4) -> list[str]:
    """``ids`` in at most ``width`` characters each, cut where they do not differ: the
    prefix and the suffix they all share shrink to a few characters around an
    ellipsis, and what tells them apart stays (cut in its middle only if still too
    long). ``tenant-acme/agent-se-0007-of-the-fleet`` -> ``tenant…0007…leet``. Ids
    whose cuts look alike (they differ only where a cut fell) are shown around what
    tells them apart; distinct ids stay distinct."""
    first = _cuts(ids, width, head, tail)
    alike: dict[str, set[str]] = {}
    for i, cut in zip(ids, first, strict=True):
        alike.setdefault(cut, set()).add(i)
    regroup: dict[str, str] = {}  # each look-alike group cut again among itself
    for group in (sorted(g) for g in alike.values() if len(g) > 1):
        regroup.update(zip(group, _cuts(group, width, head, tail), strict=True))
    candidates = (
        first,
        [regroup.get(i, cut) for i, cut in zip(ids, first, strict=True)],
        [
            cut if i not in regroup else _around_difference(i, ids, width)
            for i, cut in zip(ids, first, strict=True)
        ],
        [_around_difference(i, ids, width) for i in ids],
    )
    for tried in candidates:
        if len(set(tried)) == len(set(ids)):
            return tried
    # still alike (each differs from the others in several places): numbered
    out: list[str] = []
    for cut in candidates[-1]:
        mark = f"~{len(out) + 1}" if cut in out else ""  # the row's number: unique
        out.append(cut[: width - len(mark) - 1] + "…" + mark if mark else cut)
    return out


def _cuts(ids: list[str], width: int, head: int, tail: int) -> list[str]:
    if all(len(i) <= width for i in ids):
        return list(ids)
    if len(set(ids)) < 2:
        return [cut_middle(i, width) for i in ids]
    pre = _shared_start(ids)
    suf = _shared_start([i[len(pre) :][::-1] for i in ids])[::-1]
    start = pre if len(pre) <= head + 1 else pre[:head] + "…"
    end = suf if len(suf) <= tail + 1 else "…" + suf[len(suf) - tail :]
    out = []
    for i in ids:
        core = i[len(pre) : len(i) - len(suf)]
        room = width - len(start) - len(end)
        out.append(start + cut_middle(core, room) + end if room >= 3 else cut_middle(i, width))
    return out


def _around_difference(i: str, others: list[str], width: int) -> str:
    """``i`` in ``width`` characters, an ellipsis before the part from its first
    character that no other id of ``others`` shares at that place."""
    if len(i) <= width or not [o for o in others if o != i]:
        return cut_middle(i, width)
    at = max(len(_shared_start([i, o])) for o in others if o != i)
    start = max(0, min(at - width // 2, len(i) - width + 1))
    return ("…" + i[start + 1 : start + width]) if start else i[: width - 1] + "…"


def _shared_start(texts: list[str]) -> str:
    """The longest start every text has (character by character)."""
    first, last = min(texts), max(texts)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n]


def cut_middle(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: its start and its (longer) end around an
    ellipsis, so that ids which share a long prefix stay distinct."""
    if len(text) <= width:
        return text
    if width <= 1:
        return text[:width]
    head = (width - 1) // 3
    return text[:head] + "…" + text[len(text) - (width - 1 - head) :]


def wait_for_key(stream: IO[str] | None, timeout: float) -> str | None:
    """The key pressed on ``stream`` within ``timeout`` seconds, or None (the whole
    timeout waited). No stream, or one at its end: just waits."""
    import os
    import select
    import time

    if stream is None:
        time.sleep(timeout)
        return None
    try:
        ready, _, _ = select.select([stream], [], [], timeout)
        if not ready:
            return None
        ch = os.read(stream.fileno(), 1)
    except (OSError, ValueError):  # no file descriptor (captured, closed)
        time.sleep(timeout)
        return None
    if not ch:  # end of input: no more keys will come
        time.sleep(timeout)
        return None
    return ch.decode(errors="replace")


@contextmanager
def _cbreak(stream: IO[str] | None) -> Iterator[None]:
    """Keys arrive one by one, unechoed, while the live view runs (a terminal only)."""
    try:
        import termios
        import tty

        fd = stream.fileno() if stream is not None and stream.isatty() else None
    except (ImportError, OSError, ValueError):
        fd = None
    if fd is None:
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def cmd_scope(args: argparse.Namespace, out: Console) -> int:
    """A budget scope's window: ceilings, what is charged and held, what is left, the
    refusals and what settles billed past their holds, and each bucket kept."""
    import json

    from rich.table import Table

    from ledger.client import Ledger

    with Ledger.from_settings(_settings(args)) as ledger:
        u = ledger.scope_usage(args.scope)
    if args.json:
        print(json.dumps(scope_json(u)))
        return EXIT_OK
    out.print(
        f"[bold]{u.scope}[/]  {_window(u)}  open holds {u.open_holds}  "
        f"refused {u.refused}  billed past holds {u.over} tokens, {u.over_money} micro-cents"
    )
    out.print(scope_table(u))
    b = Table("bucket start (ms)", "input", "output", "cached_input", "money", "billed past holds")
    for start, v in u.buckets.items():
        b.add_row(
            str(start),
            *(str(v.get(q, 0)) for q in ("input", "output", "cached_input", "money")),
            str(v.get("over", 0)),
        )
    out.print(b)
    return EXIT_OK


def cmd_top(args: argparse.Namespace, out: Console, keys: IO[str] | None = None) -> int:
    from rich.live import Live

    from ledger.client import Ledger

    # Without --limit, as many rows as the terminal has lines, measured again for each
    # frame (a resized terminal gets its rows on the next refresh), as is its width.
    view = TopView(args.limit, args.sort, args.match, args.tenant)
    keys = sys.stdin if keys is None else keys
    with Ledger.from_settings(_settings(args)) as ledger:
        if args.once:
            if not out.is_terminal and "COLUMNS" not in os.environ:
                # piped: the ids whole, however wide (a terminal's 80 columns do not apply)
                whole = view.frame(ledger, None, height=out.height)
                out.width = view.natural
                out.print(whole)
            else:
                out.print(view.frame(ledger, out.width, height=out.height))
            return EXIT_OK

        def now() -> Group:
            return view.frame(ledger, out.width, True, out.height)

        with _cbreak(keys), Live(now(), console=out, refresh_per_second=4) as live:
            try:
                while wait_for_key(keys, args.interval) not in ("q", "Q"):
                    live.update(now())
            except KeyboardInterrupt:
                pass
    return EXIT_OK


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
    d.add_argument("--workers", type=int, default=4, help="fleet workers (default 4)")
    d.add_argument("--max-turns", type=int, default=130, help="cap on session length")
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


if __name__ == "__main__":
    sys.exit(main())
