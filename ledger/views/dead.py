"""The dead letters (``ledger dead``): jobs the worker gave up on, listed, shown, put back
on their job streams, purged; and the sessions that have one (``ledger top``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ledger import schema
from ledger.client import Ledger
from ledger.errors import InvalidArgument, LedgerError, translated

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
