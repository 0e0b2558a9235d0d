"""Read-only views for operators: one session in detail, the busiest sessions, dead
letters, and budget scopes (a tenant in detail; the scopes the worker exports)."""

from __future__ import annotations

import fnmatch
import heapq
import struct
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.cluster import RedisCluster

from ledger import protocol, schema
from ledger.client import Ledger
from ledger.core import collect
from ledger.errors import (
    DamagedSession,
    InvalidArgument,
    LedgerError,
    UnknownScope,
    UnknownSession,
    translated,
)
from ledger.models import AuditReport, Consumer, HeldItem, Regime, ScopeUsage, Snapshot
from ledger.protocol import Call
from ledger.scope_reads import scope_names, scope_reads
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


BATCH = 500  # calls per round trip; read-only calls, each atomic on its own


def _batches(ids: Sequence[str], size: int = BATCH) -> Iterator[Sequence[str]]:
    for i in range(0, len(ids), size):
        yield ids[i : i + size]


def placements(ledger: Ledger, only: Collection[str] | None = None) -> dict[str, list[int]]:
    """Every session id SCAN finds (on a cluster, on every primary), or only those of
    ``only``, with the partitions a session hash of it is under, in ascending order.
    An id under two or more partitions was opened by clients configured with different
    partition counts: each client sees only its own copy (see ``ledger audit``)."""
    ledger.check_open()
    out: dict[str, list[int]] = {}
    with translated():
        for k in ledger.client.scan_iter(match=ledger.keyspace.session_pattern(), count=1000):
            parts = ledger.keyspace.session_key_parts(
                k.decode() if isinstance(k, bytes) else str(k)
            )
            if parts is not None and (only is None or parts[1] in only):
                out.setdefault(parts[1], []).append(parts[0])
    return {sid: sorted(ps) for sid, ps in out.items()}


def listed(ledger: Ledger) -> list[str]:
    """The session ids SCAN finds (on a cluster, on every primary), tombstones of
    closed sessions included: the read-only scripts below refuse those (NOSESSION),
    which saves confirming each id first."""
    return sorted(placements(ledger))


def raw_many(ledger: Ledger, calls: Sequence[Call[Any]]) -> list[object]:
    """The raw replies of read-only calls (snapshot, audit), each one's reply or its
    error, in one pipelined round trip without MULTI/EXEC: each call is atomic on its
    own and they need no order between them. On a cluster, where redis-py pipelines no
    EVALSHA, one call after the other."""
    if isinstance(ledger.client, RedisCluster):
        return [ledger._try(c) for c in calls]
    ledger.check_open()
    with translated():
        return ledger._send_batch(list(calls), transaction=False)


def read_many(ledger: Ledger, calls: Sequence[Call[Any]]) -> list[Any]:
    """Read-only calls (see ``raw_many``): each one's result or its error."""
    return collect(calls, raw_many(ledger, calls), return_exceptions=True)


def snapshots(
    ledger: Ledger, ids: Sequence[str], damaged: dict[str, str] | None = None
) -> list[tuple[str, Snapshot]]:
    """A snapshot of each session, ``BATCH`` sessions per round trip (each snapshot is
    atomic on its own); sessions closed or expired since they were listed are left out,
    and so are damaged ones (a field that holds no number), each put in ``damaged``
    with what is wrong when it is given (else raised)."""
    out: list[tuple[str, Snapshot]] = []
    for chunk in _batches(ids):
        calls = [protocol.snapshot(ledger.keyspace.session(sid)) for sid in chunk]
        for sid, res in zip(chunk, read_many(ledger, calls), strict=True):
            if isinstance(res, UnknownSession):
                continue
            if isinstance(res, DamagedSession) and damaged is not None:
                damaged[sid] = _damage(res.field, res.value)
                continue
            if isinstance(res, LedgerError) and damaged is not None:
                damaged[sid] = unreadable(res)
                continue
            if isinstance(res, BaseException):
                raise res
            out.append((sid, res))
    return out


@dataclass(frozen=True, slots=True)
class Damaged:
    """A session whose stored hash cannot be read as the ledger's scripts write it (a
    field missing, or holding what is not a number or not of its layout): ``problems``
    name each field and what it holds. It gets no verdict; every other session does."""

    session_id: str
    problems: tuple[str, ...]


def audits(
    ledger: Ledger, ids: Sequence[str]
) -> Iterator[tuple[str, AuditReport | Damaged | UnknownSession]]:
    """Each session's audit, in order, ``BATCH`` sessions per round trip: the report,
    ``Damaged`` for a session whose hash cannot be audited (``audit.lua`` names what is
    wrong instead of failing), or the UnknownSession error of a session closed or
    expired since it was listed."""
    for chunk in _batches(ids, 100):  # an audit reads the whole session hash
        calls = [protocol.audit(ledger.keyspace.session(sid)) for sid in chunk]
        raws = raw_many(ledger, calls)
        results = collect(calls, raws, return_exceptions=True)
        for sid, raw, res in zip(chunk, raws, results, strict=True):
            if isinstance(res, AuditReport) and schema.text(raw).startswith("status=damaged|"):
                yield sid, Damaged(sid, res.problems)
            elif isinstance(res, UnknownSession) or not isinstance(res, BaseException):
                yield sid, res
            elif isinstance(res, LedgerError):  # its own call failed (a key not a hash)
                yield sid, Damaged(sid, (f"damaged: {unreadable(res)}",))
            else:
                raise res


# The fields a row of `top` is ranked by: utilization = (S + T + a_w + a_rm + a_s) / W.
_RANK = (
    schema.WINDOW,
    schema.SYSTEM_PROMPT,
    schema.TOOL_FRAMING,
    schema.ACTIVE_WORKING,
    schema.ACTIVE_MEMORY,
    schema.ACTIVE_SCRATCHPAD,
    schema.FREE,
    schema.DRIFT,
    schema.TURN,
)

# ledger top --sort: the rank of a session's row, from the fields of its snapshot reply
SORTS: dict[str, Callable[[dict[str, int]], float]] = {
    "util": lambda v: sum(v[f] for f in _RANK[1:6]) / v[schema.WINDOW],
    "free": lambda v: -v[schema.FREE],  # the least free room first
    "refused": lambda v: v.get(schema.COUNTER.of("refused"), 0),
    "drift": lambda v: abs(v[schema.DRIFT]),
    "turn": lambda v: v[schema.TURN],
}


def busiest(
    ledger: Ledger,
    limit: int = 10,
    sort: str = "util",
    match: str | None = None,
    ids: list[str] | None = None,
    damaged: dict[str, str] | None = None,
) -> tuple[list[tuple[str, Snapshot]], dict[str, int]]:
    """The sessions ranked first by `sort` (SORTS: utilization by default), among those
    whose id matches the glob `match`, and the indicators summed over those sessions.
    Every session's snapshot is read (``BATCH`` per round trip); only the rows shown
    are parsed whole, the others only for their rank and counters. A damaged session
    (a field that holds no number) is ranked nowhere: it goes into ``damaged`` with
    what is wrong when that is given, else its DamagedSession is raised."""
    rank = SORTS[sort]
    totals: dict[str, int] = {}
    ranked: list[tuple[float, str, object]] = []
    where: dict[str, int] = {}  # field -> position in the reply (its order is fixed)
    ids = listed(ledger) if ids is None else ids  # (the caller's SCAN, if it made one)
    if match is not None:
        ids = [sid for sid in ids if fnmatch.fnmatchcase(sid, match)]
    for chunk in _batches(ids):
        calls = [protocol.snapshot(ledger.keyspace.session(sid)) for sid in chunk]
        for sid, call, raw in zip(chunk, calls, raw_many(ledger, calls), strict=True):
            if isinstance(raw, BaseException):
                res = collect([call], [raw], return_exceptions=True)[0]
                if isinstance(res, UnknownSession):  # closed or expired
                    continue
                if damaged is None:
                    raise res
                damaged[sid] = unreadable(res)  # its own call failed (a key not a hash)
                continue
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            parts = text.split("|")
            if not where:
                where = {
                    p.partition("=")[0]: i
                    for i, p in enumerate(parts)
                    if p.partition("=")[0] in _RANK or p.startswith(schema.COUNTER.prefix)
                }
            v = {}
            for name, i in where.items():
                k, _, val = parts[i].partition("=")
                if k != name:  # another layout: read it by name
                    return _busiest_by_name(ledger, limit, ids, rank, damaged)
                if not _whole(val):
                    if damaged is None:
                        raise DamagedSession(name, val)
                    damaged[sid] = _damage(name, val)
                    break
                v[name] = int(val)
            if sid in (damaged or ()):
                continue
            if v[schema.WINDOW] <= 0:  # no window: no utilization to rank it by
                if damaged is None:
                    raise DamagedSession(schema.WINDOW, str(v[schema.WINDOW]))
                damaged[sid] = (
                    f"field {str(schema.WINDOW)!r} holds {v[schema.WINDOW]}, not a window"
                )
                continue
            for name, n in v.items():
                if name.startswith(schema.COUNTER.prefix):
                    totals[name[2:]] = totals.get(name[2:], 0) + n
            ranked.append((rank(v), sid, raw))
    # Only the rows shown are parsed whole: one damaged in a field the rank does not read
    # is found here, and the next one in rank takes its place.
    want = limit
    while True:
        shown = []
        top = heapq.nlargest(want, ranked, key=lambda row: row[0])
        for _, sid, raw in top:
            call = protocol.snapshot(ledger.keyspace.session(sid))
            try:
                shown.append((sid, collect([call], [raw], False)[0]))
            except DamagedSession as exc:
                if damaged is None:
                    raise
                damaged[sid] = _damage(exc.field, exc.value)
        if len(shown) >= limit or len(top) == len(ranked):
            return shown[:limit], totals
        want += limit - len(shown)


@dataclass(frozen=True, kw_only=True)
class FleetStatus:
    """The header of ``ledger top``: job streams summed over partitions."""

    lag: int  # jobs not yet delivered to the workers' group
    pending: int  # delivered, not acknowledged
    dead: int  # in the dead-letter streams
    groups: int  # partitions whose stream has a consumer group (0: no worker ever ran)


def fleet_status(ledger: Ledger) -> FleetStatus:
    """Lag, pending and dead letters over every partition, in one pipelined round trip
    (XINFO GROUPS and XLEN per partition; a stream not made yet counts 0)."""
    ks = ledger.keyspace
    lag = pending = dead = groups = 0
    with translated(), ledger.client.pipeline(transaction=False) as pipe:
        for p in range(ks.partitions):
            pipe.xinfo_groups(ks.jobs(p))
            pipe.xlen(ks.dead_letters(p))
        replies = pipe.execute(raise_on_error=False)
    for info, length in zip(replies[::2], replies[1::2], strict=True):
        if isinstance(info, list) and info:
            groups += 1
            lag += max(int(g.get("lag") or 0) for g in info)
            pending += max(int(g.get("pending") or 0) for g in info)
        if isinstance(length, int):
            dead += length
    return FleetStatus(lag=lag, pending=pending, dead=dead, groups=groups)


def unreadable(exc: LedgerError) -> str:
    """What is wrong with a session whose own read-only call failed (the other sessions'
    calls did not): a key of its name that is not a hash, most likely."""
    return f"its call failed: {exc}"


def _whole(text: str) -> bool:
    return text.removeprefix("-").isdigit()


def _damage(field: str, value: str) -> str:
    return f"field {field!r} holds {value[:40]!r}, not a number"


def _busiest_by_name(
    ledger: Ledger,
    limit: int,
    ids: list[str],
    rank: Callable[[dict[str, int]], float],
    damaged: dict[str, str] | None = None,
) -> tuple[list[tuple[str, Snapshot]], dict[str, int]]:
    rows = snapshots(ledger, ids, damaged)
    totals: dict[str, int] = {}
    for _, snap in rows:
        for name, value in snap.raw.items():
            if name.startswith(schema.COUNTER.prefix):
                totals[name[2:]] = totals.get(name[2:], 0) + value
    rows.sort(key=lambda r: rank(r[1].raw), reverse=True)
    return rows[:limit], totals


# --- dead letters ---------------------------------------------------------------------

# The fields of a job as the scripts write it (docs/protocol.md#the-job-stream): what a
# replay writes back to the partition's job stream.
JOB_FIELDS = schema.JOB_FIELDS


@dataclass(frozen=True, kw_only=True)
class DeadLetter:
    """One job the worker gave up on: ``ref`` is ``p<partition>:<entry id>`` (entry ids
    repeat across partitions); ``job`` the entry id it had in the job stream."""

    ref: str
    partition: int
    entry: str
    fields: dict[str, str]

    @property
    def job(self) -> dict[str, str]:
        return {k: self.fields[k] for k in JOB_FIELDS if k in self.fields}

    @property
    def dead_since_ms(self) -> int:
        """When it was dead-lettered (Redis's clock, ms): its entry id's first part."""
        return int(self.entry.partition("-")[0])


def redis_now_ms(ledger: Ledger) -> int:
    """Redis's clock (TIME), in ms: what a dead letter's age is measured against."""
    with translated():
        secs, micros = ledger.client.time()
    return int(secs) * 1000 + int(micros) // 1000


def dead_letters(ledger: Ledger, limit: int = 100) -> tuple[dict[int, int], list[DeadLetter]]:
    """Every partition's dead-letter depth (non-empty ones), and up to ``limit`` of the
    oldest letters, partition by partition."""
    depths: dict[int, int] = {}
    letters: list[DeadLetter] = []
    with translated():
        for p in range(ledger.keyspace.partitions):
            name = ledger.keyspace.dead_letters(p)
            n = int(ledger.client.xlen(name))
            if not n:
                continue
            depths[p] = n
            if len(letters) < limit:
                for eid, fields in ledger.client.xrange(name, count=limit - len(letters)) or []:
                    e = schema.text(eid)
                    letters.append(
                        DeadLetter(
                            ref=f"p{p}:{e}",
                            partition=p,
                            entry=e,
                            fields={
                                schema.text(k): schema.text(v) for k, v in (fields or {}).items()
                            },
                        )
                    )
    return depths, letters


def session_dead_letters(ledger: Ledger, session_id: str, scan: int = 1000) -> list[DeadLetter]:
    """The dead letters of one session among the newest ``scan`` of its partition's
    dead-letter stream, newest first (what ``ledger inspect`` names)."""
    p = ledger.keyspace.partition_of(session_id)
    out = []
    with translated():
        got = ledger.client.xrevrange(ledger.keyspace.dead_letters(p), count=scan) or []
    for eid, raw in got:
        fields = {schema.text(k): schema.text(v) for k, v in (raw or {}).items()}
        if fields.get(schema.JOB_SESSION) == session_id:
            e = schema.text(eid)
            out.append(DeadLetter(ref=f"p{p}:{e}", partition=p, entry=e, fields=fields))
    return out


def _parse_ref(ref: str, partitions: int) -> tuple[int, str]:
    head, sep, entry = ref.partition(":")
    if not sep or not head.startswith("p") or not head[1:].isdigit() or not entry:
        raise InvalidArgument(f"a dead letter is named p<partition>:<entry id>, got {ref!r}")
    p = int(head[1:])
    if p >= partitions:
        raise InvalidArgument(f"partition {p} of {ref!r} is not below {partitions}")
    return p, entry


def take_dead(ledger: Ledger, refs: Sequence[str] | None) -> list[DeadLetter]:
    """The letters named (None: every one), each read back; a missing one is an error
    (``ledger dead show``, ``list`` with names, ``replay``, ``purge``)."""
    if refs is None:
        return dead_letters(ledger, limit=10**9)[1]
    found = []
    with translated():
        for ref in refs:
            p, entry = _parse_ref(ref, ledger.keyspace.partitions)
            got = ledger.client.xrange(ledger.keyspace.dead_letters(p), entry, entry)
            if not got:
                raise LedgerError(f"no dead letter {ref!r} (listed, replayed or purged?)")
            fields = {schema.text(k): schema.text(v) for k, v in (got[0][1] or {}).items()}
            found.append(DeadLetter(ref=ref, partition=p, entry=entry, fields=fields))
    return found


def replay_dead(ledger: Ledger, refs: Sequence[str] | None) -> list[str]:
    """Put dead letters back on their partition's job stream (a new entry: the worker
    runs it as a new job, fenced like any other by the session's epoch and state), and
    remove them from the dead-letter stream. Returns the new entry ids."""
    out = []
    for letter in take_dead(ledger, refs):
        ks, p = ledger.keyspace, letter.partition
        with translated():
            new = ledger.client.xadd(ks.jobs(p), dict(letter.job))  # type: ignore[arg-type]
            ledger.client.xdel(ks.dead_letters(p), letter.entry)
        out.append(schema.text(new))
    return out


def purge_dead(ledger: Ledger, refs: Sequence[str] | None) -> int:
    """Delete dead letters (None: all of them). Returns how many were deleted."""
    n = 0
    for letter in take_dead(ledger, refs):
        with translated():
            n += int(
                ledger.client.xdel(ledger.keyspace.dead_letters(letter.partition), letter.entry)
            )
    return n


# --- budget scopes (docs/ceilings.md) --------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ScopeHold:
    """An open hold of a scope: a reservation of a session, what it holds per quantity
    (``ScopeUsage``'s names), until ``deadline_ms`` on Redis's clock (``overdue`` past it:
    the next reserve in the scope gives it back)."""

    scope: str
    session_id: str
    reservation: str
    deadline_ms: int
    held: Mapping[str, int]
    overdue: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantView:
    """A tenant as ``ledger inspect --tenant`` shows it: its scopes' windows (the tenant's
    own first), their open holds (soonest deadline first) and its sessions' ids."""

    tenant: str
    now_ms: int
    scopes: list[ScopeUsage]
    holds: list[ScopeHold]
    sessions: list[str]


def tenant_view(ledger: Ledger, tenant: str) -> TenantView:
    names = scope_names(ledger, tenant)
    now, reads = scope_reads(ledger, names)
    usages, holds = [], []
    for name, fields, index in reads:
        try:
            usages.append(protocol.scope_usage(name, fields, index, now))
        except UnknownScope:
            continue
        except (
            ValueError,
            IndexError,
            KeyError,
            struct.error,
        ) as exc:  # written by hand or by another program
            raise LedgerError(
                f"scope {name}: damaged: its hash does not read as the scripts write it "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        for member, deadline in index:
            sid, _, rid = member.rpartition("|")
            raw = schema.text(fields.get("q:" + member, ""))
            parts = raw.split("|")
            if len(parts) < 5 or not all(_whole(x) for x in parts[:5]):
                continue  # given back since the index was read
            held = dict(
                zip(("input", "output", "cached_input", "money"), map(int, parts[1:5]), strict=True)
            )
            holds.append(
                ScopeHold(
                    scope=name,
                    session_id=sid,
                    reservation=rid,
                    deadline_ms=int(deadline),
                    held=held,
                    overdue=deadline < now,
                )
            )
    usages.sort(key=lambda u: (u.scope != tenant, u.scope))
    holds.sort(key=lambda h: (h.deadline_ms, h.scope, h.session_id, h.reservation))
    mine = f"@{tenant}/"
    sessions = [sid for sid in listed(ledger) if sid.startswith(mine)]
    return TenantView(tenant=tenant, now_ms=now, scopes=usages, holds=holds, sessions=sessions)


def dead_lettered(ledger: Ledger, scan: int = 1000) -> dict[str, list[int]]:
    """Each session with a dead letter among the newest ``scan`` of its partition's
    dead-letter stream, and the epoch of each of its letters, newest first (-1: none
    written), what ``ledger top`` flags: the partitions' depths and their letters in two
    pipelined round trips."""
    ks = ledger.keyspace
    with translated(), ledger.client.pipeline(transaction=False) as pipe:
        for p in range(ks.partitions):
            pipe.xlen(ks.dead_letters(p))
        depths = pipe.execute(raise_on_error=False)
    full = [p for p, n in enumerate(depths) if isinstance(n, int) and n > 0]
    out: dict[str, list[int]] = {}
    if not full:
        return out
    with translated(), ledger.client.pipeline(transaction=False) as pipe:
        for p in full:
            pipe.xrevrange(ks.dead_letters(p), count=scan)
        got = pipe.execute(raise_on_error=False)
    for entries in got:
        for _, raw in entries if isinstance(entries, list) else ():
            fields = {schema.text(k): schema.text(v) for k, v in (raw or {}).items()}
            sid = fields.get(schema.JOB_SESSION)
            if sid:
                epoch = fields.get(schema.JOB_EPOCH, "")
                out.setdefault(sid, []).append(int(epoch) if epoch.isdigit() else -1)
    return out
