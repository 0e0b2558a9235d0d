"""Helpers for the worker tests (tests/test_worker_processes.py, _in_process, _regressions,
_reads, _lifecycle, _dead_letters): compactors named to the workers by import path,
sessions that enqueue jobs, the job streams read back (backlog, dead letters, pending
entries), waiting for them to drain, and in-process workers. No tests here.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ledger import Item, Ledger, LedgerSettings
from ledger.models import Consumer
from ledger.workers.compactors import CompactionPlan, CompactionRequest
from ledger.workers.runner import Worker
from tests.support import jobs
from tests.support.jobs import BUDGET, GROUP, WM_ITEMS, session_hash
from tests.support.servers import RedisProcess

ROOT = Path(__file__).resolve().parents[2]
PARTITIONS = 4
CLAIM_IDLE_MS = 500
POLL = 0.02
COMPACTOR = "tests.support.worker_scenarios:fleet_compactor"


def fleet_compactor(request: CompactionRequest) -> CompactionPlan:
    """The tests' summarizer, deterministic and independent of ``simulated``'s tuning:
    every working-memory item but the two newest gives way to one summary of 10-60% of
    their size (a hash of session, turn and newest item picks the share; not the epoch,
    which is Redis's clock at the session's creation and differs between runs), so a
    first compaction misses H (summary > 500 tokens) about 70% of the time and a second
    one always makes it. ``easy-*`` sessions get 10% (always compacted at once);
    ``stuck-*`` sessions nothing at all (three failed compactions escalate to a reset)."""
    wm = [i for i in request.items if i.consumer is Consumer.WORKING_MEMORY]
    old, sid = wm[:-2], request.session_id
    if sid.startswith("stuck-") or not old:
        return CompactionPlan((), None)
    newest = wm[-1].seq
    share = 0.10
    if not sid.startswith("easy-"):
        key = f"{sid}|{request.turn}|{newest}".encode()
        share += 0.50 * int.from_bytes(hashlib.blake2b(key, digest_size=2).digest()) / 65535
    tokens = max(1, int(sum(i.tokens for i in old) * share))
    summary = Item(f"sum-t{request.turn}-q{newest}", tokens, 1000)
    return CompactionPlan(tuple((i.consumer, i.id) for i in old), summary)


_flaky_seen: set[str] = set()


def always_fails(request: CompactionRequest) -> CompactionPlan:
    """A summarizer that is down: every job it gets ends dead-lettered."""
    raise RuntimeError("summarizer down")


def flaky_compactor(request: CompactionRequest) -> CompactionPlan:
    """Raises on its first call for a session, then behaves like fleet_compactor."""
    if request.session_id not in _flaky_seen:
        _flaky_seen.add(request.session_id)
        raise RuntimeError("summarizer timed out")
    return fleet_compactor(request)


def new_ledger(server: RedisProcess, prefix: str | None = None) -> Ledger:
    prefix = prefix or f"w{uuid.uuid4().hex[:12]}"
    return Ledger.from_settings(
        LedgerSettings(redis_url=server.url, prefix=prefix, partitions=PARTITIONS)
    )


def open_compaction(led: Ledger, sid: str) -> None:
    """A session whose end_turn enqueues a `compact` job."""
    s = led.open_session(sid, BUDGET)
    s.admit("working_memory", WM_ITEMS)
    assert s.end_turn(0, 8_000).compaction_due


Job = tuple[str, str]  # (session id, stream entry id): entry ids repeat across partitions


def open_resets(led: Ledger, sids: list[str]) -> list[Job]:
    """Open sessions and append one hard_reset job each (the shape the scripts write)."""
    for sid in sids:
        led.open_session(sid, BUDGET)
    return enqueue_resets(led, sids)


def enqueue_resets(led: Ledger, sids: list[str]) -> list[Job]:
    """One hard_reset job per session, at the session's current epoch."""
    pipe = led.client.pipeline(transaction=False)
    for sid in sids:
        pipe.hget(led.keyspace.session(sid).session, "ep")
    epochs = pipe.execute()
    pipe = led.client.pipeline(transaction=False)
    for sid, epoch in zip(sids, epochs, strict=True):
        pipe.xadd(jobs_of(led, sid), reset_fields(sid, int(epoch)))
    return [(sid, _text(x)) for sid, x in zip(sids, pipe.execute(), strict=True)]


def reset_fields(sid: str, epoch: int) -> dict[Any, Any]:
    return {"kind": "hard_reset", "session": sid, "epoch": epoch, "reason": "test", "op": "x"}


def jobs_of(led: Ledger, sid: str) -> str:
    return led.keyspace.jobs(led.keyspace.partition_of(sid))


def entries_for(led: Ledger, sid: str) -> list[tuple[str, dict[str, str]]]:
    """The entries of a session's partition stream that name that session."""
    out = []
    for eid, raw in xrange(led, jobs_of(led, sid)):
        fields = {_text(k): _text(v) for k, v in raw.items()}
        if fields.get("session") == sid:
            out.append((_text(eid), fields))
    return out


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def xrange(led: Ledger, stream: str, lo: str = "-", hi: str = "+", **kw: Any) -> list[Any]:
    """XRANGE as [(entry id, {field: value})] (raw bytes), typed for the tests."""
    return list(led.client.xrange(stream, min=lo, max=hi, **kw) or [])


@dataclass
class Backlog:
    undelivered: int = 0  # after the group's last-delivered id
    pending: int = 0  # delivered, not acknowledged
    leftover: list[Job] = field(default_factory=list)  # acknowledged, never deleted

    @property
    def clear(self) -> bool:
        return self.undelivered == 0 and self.pending == 0


def backlog(led: Ledger) -> Backlog:
    c, out = led.client, Backlog()
    for p in range(PARTITIONS):
        stream = led.keyspace.jobs(p)
        if not c.exists(stream):
            continue
        [g] = [g for g in c.xinfo_groups(stream) if _text(g["name"]) == GROUP]
        last = _text(g["last-delivered-id"])
        out.pending += int(g["pending"])
        out.undelivered += len(xrange(led, stream, f"({last}"))
        pending = {
            _text(r["message_id"])
            for r in c.xpending_range(stream, GROUP, min="-", max="+", count=100_000)
        }
        for eid, raw in xrange(led, stream, "-", last):
            if _text(eid) not in pending:
                out.leftover.append((_text(raw.get(b"session", b"?")), _text(eid)))
    return out


def dead_letters(led: Ledger) -> list[dict[str, str]]:
    out = []
    for p in range(PARTITIONS):
        for eid, fields in xrange(led, f"{led.keyspace.tag(p)}:dead"):
            out.append({"id": _text(eid), **{_text(k): _text(v) for k, v in fields.items()}})
    return out


SIG_FIELDS: tuple[str, ...] = ("ep", "tn", "kn", "kf", "cd", "rq", "fr", "a_w", "u_w", "n_w")

SIG_FIELDS += ("x:failed_compactions", "x:escalations", "x:resets")


def signature(led: Ledger, sid: str) -> tuple[Any, ...]:
    h = session_hash(led, sid)
    items = tuple((it.consumer.value, it.id, it.tokens) for it in led.items(sid))
    return (*(h.get(f, "0") for f in SIG_FIELDS), items)


def wait_until(
    pred: Callable[[], bool],
    timeout: float,
    what: str,
    step: float = 0.02,
    detail: Callable[[], object] = lambda: "",
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} {detail()}")


def drained(led: Ledger, timeout: float = 30) -> Backlog:
    """Wait until nothing is undelivered or pending; returns the final backlog."""
    wait_until(
        lambda: backlog(led).clear,
        timeout,
        "the streams to drain",
        detail=lambda: (backlog(led), pending_detail(led), dead_letters(led)[:3]),
    )
    return backlog(led)


def pending_detail(led: Ledger) -> list[tuple[int, str, str, int, int]]:
    out = []
    for p in range(PARTITIONS):
        stream = led.keyspace.jobs(p)
        if led.client.exists(stream):
            for r in led.client.xpending_range(stream, GROUP, min="-", max="+", count=20):
                out.append(
                    (
                        p,
                        _text(r["message_id"]),
                        _text(r["consumer"]),
                        int(r["time_since_delivered"]),
                        int(r["times_delivered"]),
                    )
                )
    return out


def drain_in_process(led: Ledger, worker: Worker, timeout: float = 20.0) -> None:
    worker.ensure_groups()
    deadline = time.monotonic() + timeout
    while not backlog(led).clear:
        assert time.monotonic() < deadline, f"not drained: {backlog(led)}"
        if not worker.poll_once():
            time.sleep(0.01)
    assert backlog(led) == Backlog()


def in_process_worker(led: Ledger, compactor: str = COMPACTOR, **kw: Any) -> Worker:
    return jobs.new_worker(led, compactor, **kw)


def views_dead(led: Ledger) -> int:
    from ledger import views

    return sum(views.dead_letters(led)[0].values())
