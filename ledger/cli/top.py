"""``ledger top``: the live view of the busiest sessions, and how it fits ids and lines
to the terminal's width."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING

from ledger import schema
from ledger.cli.common import EXIT_OK, _age, _settings

if TYPE_CHECKING:
    from rich.console import Console, Group

    from ledger.client import Ledger
    from ledger.models import Snapshot


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
