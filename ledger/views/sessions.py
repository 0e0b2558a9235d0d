"""One session in detail (``ledger inspect``): its snapshot, regime, items,
reservations, journal and counters, and the outcome kept for an op id."""

from __future__ import annotations

from dataclasses import dataclass

from ledger import protocol, schema
from ledger.client import Ledger
from ledger.errors import translated
from ledger.models import Consumer, HeldItem, Regime, Snapshot
from ledger.scripts import is_bucket, outcome_buckets, outcome_key, stored_outcomes


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One stored outcome. The op id itself is not stored: ``op_key`` is the first 16
    hex digits of its SHA-1 (``ledger.scripts.outcome_key``), which is how to find a
    given op id's entry."""

    op_key: str
    reply: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionView:
    session_id: str
    snapshot: Snapshot
    regime: Regime
    items: list[HeldItem]
    reservations: list[tuple[str, Consumer, int, int]]  # id, consumer, tokens, deadline ms
    journal: list[JournalEntry]  # outcomes kept for retries, current generation first
    counters: dict[str, int]


def regime(snap: Snapshot, working_set: int) -> Regime:
    """The starvation gate's regime for a declared working set (the last begin_turn's):
    docs/rules.md#working-memory-starvation."""
    wm = Consumer.WORKING_MEMORY
    need = max(working_set, snap.used[wm] + snap.reserved[wm], snap.working_memory_floor)
    if snap.residual_working_memory >= need:
        return Regime.OK
    return Regime.LOUD if snap.occupancy >= snap.eviction_threshold else Regime.STARVATION


def view(ledger: Ledger, session_id: str, journal: int = 10) -> SessionView:
    keys = ledger.keyspace.session(session_id)
    snap = ledger.run(protocol.snapshot(keys))
    with translated():
        fields = ledger.client.hgetall(keys.session)
    raw = {schema.text(k): schema.text(v) for k, v in fields.items()}
    reservations = []
    entries: list[JournalEntry] = []
    counters = {}
    for name, value in raw.items():
        if name.startswith(schema.RESERVATION.prefix):
            code, tokens, deadline = value.split("|")
            reservations.append((name[2:], Consumer.from_code(code), int(tokens), int(deadline)))
        elif name.startswith(schema.COUNTER.prefix) and value.lstrip("-").isdigit():
            counters[name[2:]] = int(value)
    with translated():
        for k in (keys.outcomes, keys.outcomes_old):
            base = int(ledger.client.hget(k, schema.EPOCH_BASE) or 0)
            for field, bucket in ledger.client.hscan_iter(k):
                if len(entries) >= journal:
                    break
                if not is_bucket(schema.text(field)):
                    continue
                for key, _, reply in stored_outcomes(schema.text(bucket), base)[
                    : journal - len(entries)
                ]:
                    entries.append(JournalEntry(schema.text(field)[:2] + key, reply))
    return SessionView(
        session_id=session_id,
        snapshot=snap,
        regime=regime(snap, snap.raw.get(schema.WORKING_SET, 0)),
        items=protocol.held_items(raw),
        reservations=sorted(reservations),
        journal=entries[:journal],
        counters=counters,
    )


def stored_outcome(ledger: Ledger, session_id: str, op_id: str) -> tuple[str, str] | None:
    """Where the outcome of ``op_id`` is kept for retries, and its reply: ("current" or
    "previous" generation, reply), or None when neither generation holds it (never
    sent, refused with an error, or older than the op retention). A retry of the op id
    with the same arguments gets this reply and changes nothing."""
    keys = ledger.keyspace.session(session_id)
    _, key = outcome_key(op_id)
    ledger.check_open()
    with translated():
        for name, k in (("current", keys.outcomes), ("previous", keys.outcomes_old)):
            *raws, base = ledger.client.hmget(k, [*outcome_buckets(op_id), schema.EPOCH_BASE])
            for raw in raws:
                if raw is None:
                    continue
                for got, _, reply in stored_outcomes(schema.text(raw), int(base or 0)):
                    if got == key:
                        return name, reply
    return None
