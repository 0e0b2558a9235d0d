"""``ledger audit``, ``ledger dead`` and ``ledger scripts``: the operators' checks, the
dead letters, and the scripts as clients in other languages send them."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ledger import schema
from ledger.cli.common import EXIT_OK, EXIT_VIOLATION, _age, _settings
from ledger.errors import InvalidArgument, UnknownSession

if TYPE_CHECKING:
    from rich.console import Console


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
