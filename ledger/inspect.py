"""Read-only views for operators: one session in detail, and the busiest sessions."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ledger import protocol
from ledger.client import Ledger
from ledger.errors import UnknownSession, translated
from ledger.models import AuditReport, Consumer, HeldItem, Snapshot


@dataclass(frozen=True, slots=True)
class JournalEntry:
    ts_ms: int
    op_id: str
    reply: str


@dataclass(frozen=True, slots=True)
class SessionView:
    session_id: str
    snapshot: Snapshot
    regime: str
    items: list[HeldItem]
    reservations: list[tuple[str, str, int, int]]  # id, consumer code, tokens, deadline ms
    journal: list[JournalEntry]  # newest first
    counters: dict[str, int]


def regime(snap: Snapshot, working_set: int) -> str:
    """Record 000's regime for a declared working set (the last begin_turn's)."""
    wm = Consumer.WORKING_MEMORY
    need = max(working_set, snap.used[wm] + snap.reserved[wm], snap.working_memory_floor)
    if snap.residual_working_memory >= need:
        return "ok"
    return "loud" if snap.occupancy >= snap.eviction_threshold else "starvation"


def view(ledger: Ledger, session_id: str, journal: int = 10) -> SessionView:
    keys = ledger.keyspace.session(session_id)
    snap = ledger.run(protocol.snapshot(keys))
    with translated():
        fields = ledger.client.hgetall(keys.session)
    raw = {
        (k.decode() if isinstance(k, bytes) else str(k)): (
            v.decode() if isinstance(v, bytes) else str(v)
        )
        for k, v in fields.items()
    }
    reservations = []
    entries = []
    counters = {}
    for name, value in raw.items():
        if name.startswith("r:"):
            code, tokens, deadline = value.split("|")
            reservations.append((name[2:], code, int(tokens), int(deadline)))
        elif name.startswith("o:"):
            ts, _, rest = value.partition("|")
            _, _, reply = rest.partition("|")
            entries.append(JournalEntry(int(ts), name[2:], reply))
        elif name.startswith("x:") and value.lstrip("-").isdigit():
            counters[name[2:]] = int(value)
    entries.sort(key=lambda e: e.ts_ms, reverse=True)
    return SessionView(
        session_id,
        snap,
        regime(snap, snap.raw.get("ws", 0)),
        protocol.held_items(raw),
        sorted(reservations),
        entries[:journal],
        counters,
    )


BATCH = 100  # calls per round trip: one MULTI/EXEC; Redis serves no one else meanwhile


def _batches(ids: Sequence[str], size: int = BATCH) -> Iterator[Sequence[str]]:
    for i in range(0, len(ids), size):
        yield ids[i : i + size]


def snapshots(ledger: Ledger, ids: Sequence[str]) -> list[tuple[str, Snapshot]]:
    """A snapshot of each session, ``BATCH`` sessions per round trip (each snapshot is
    atomic on its own); sessions closed or expired since they were listed are left out."""
    out: list[tuple[str, Snapshot]] = []
    for chunk in _batches(ids):
        calls = [protocol.snapshot(ledger.keyspace.session(sid)) for sid in chunk]
        for sid, res in zip(chunk, ledger.run_many(calls, return_exceptions=True), strict=True):
            if isinstance(res, UnknownSession):
                continue
            if isinstance(res, BaseException):
                raise res
            out.append((sid, res))
    return out


def audits(
    ledger: Ledger, ids: Sequence[str]
) -> Iterator[tuple[str, AuditReport | UnknownSession]]:
    """Each session's audit, in order, ``BATCH`` sessions per round trip: the report,
    or the UnknownSession error of a session closed or expired since it was listed."""
    for chunk in _batches(ids):
        calls = [protocol.audit(ledger.keyspace.session(sid)) for sid in chunk]
        for sid, res in zip(chunk, ledger.run_many(calls, return_exceptions=True), strict=True):
            if isinstance(res, AuditReport | UnknownSession):
                yield sid, res
            elif isinstance(res, BaseException):
                raise res
            else:
                raise TypeError(f"unexpected audit result {res!r}")


def busiest(ledger: Ledger, limit: int = 10) -> tuple[list[tuple[str, Snapshot]], dict[str, int]]:
    """The sessions with the highest utilization, and the indicators summed over all."""
    rows = snapshots(ledger, ledger.session_ids())
    totals: dict[str, int] = {}
    for _, snap in rows:
        for name, value in snap.raw.items():
            if name.startswith("x:"):
                totals[name[2:]] = totals.get(name[2:], 0) + value
    rows.sort(key=lambda r: r[1].utilization, reverse=True)
    return rows[:limit], totals
