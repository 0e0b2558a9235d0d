"""Views over many sessions, read in batches of pipelined read-only calls: where each
session lives, the sessions listed, their snapshots and audits (``ledger audit``), the
busiest of them and the fleet's indicators (``ledger top``). A damaged session is named,
not a failure of the view."""

from __future__ import annotations

import fnmatch
import heapq
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from redis.cluster import RedisCluster

from ledger import protocol, schema
from ledger.client import Ledger
from ledger.core import collect
from ledger.errors import DamagedSession, LedgerError, UnknownSession, translated
from ledger.models import AuditReport, Snapshot
from ledger.protocol import Call

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
