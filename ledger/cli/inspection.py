"""``ledger inspect`` (a session, or a tenant with ``--tenant``) and ``ledger scope``."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ledger.cli.common import EXIT_OK, EXIT_VIOLATION, _settings
from ledger.errors import InvalidArgument

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from ledger.models import ScopeUsage


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
    if snap.reset_staged is not None:  # a hard reset waits for the open turn's end
        rz = snap.reset_staged
        left = rz.due_ms - snap.now_ms
        out.print(
            f"[yellow]RESET STAGED[/] ({escape(rz.reason)}): applied when turn {snap.turn} "
            f"ends, or by a reset call from {rz.due_ms} ms "
            + (f"(in {left} ms)" if left > 0 else f"(due {-left} ms ago)")
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
    # a hold past its deadline is listed (OVERDUE) until the next reserve in its scope gives
    # it back, but its scope's line already counts it given back: say how many are
    overdue = sum(h.overdue for h in v.holds)
    late = f" ({overdue} overdue)" if overdue else ""
    out.print(
        f"[bold]tenant {escape(v.tenant)}[/]  {len(v.scopes)} scopes  {len(v.holds)} open holds"
        f"{late}  {len(v.sessions)} sessions  (Redis clock {v.now_ms} ms)"
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
