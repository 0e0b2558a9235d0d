"""Helpers for the worker tests: compactors named by import path, sessions that enqueue
jobs, reading the job streams, forgetting an op id's stored outcome, and Redis made to
run out of memory. No tests here."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import redis

from ledger import Item, Ledger, SessionBudget
from ledger.models import Consumer, JobKind
from ledger.schema import JobEntry
from ledger.scripts import outcome_key, stored_outcomes
from ledger.workers.compactors import CompactionPlan, CompactionRequest
from ledger.workers.runner import Metrics, Worker, WorkerSettings

GROUP = "ledger-workers"
# H = 7_200. Working memory 8 x 250 (old) + 2 x 3_100 (newest): occupancy 8_700 > H, so
# end_turn makes a compaction due and enqueues a `compact` job.
BUDGET = SessionBudget(window=10_000, system_prompt=500, output_reserve=500)
WM_ITEMS = [Item(f"old{k}", 250) for k in range(8)] + [Item("big1", 3_100), Item("big2", 3_100)]


class CountingCompactor:
    """Never enough: replaces nothing, so every compaction it plans fails (occupancy
    stays above H). Counts its calls per session."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, request: CompactionRequest) -> CompactionPlan:
        with self._lock:
            self.calls[request.session_id] = self.calls.get(request.session_id, 0) + 1
        return CompactionPlan((), None)


never_enough = CountingCompactor()
NEVER_ENOUGH = "tests.support.jobs:never_enough"


def enough(request: CompactionRequest) -> CompactionPlan:
    """Every working-memory item but the two newest gives way to a 10% summary: always
    compacted under H at the first try."""
    wm = [i for i in request.items if i.consumer is Consumer.WORKING_MEMORY]
    old = wm[:-2]
    if not old:
        return CompactionPlan((), None)
    tokens = max(1, sum(i.tokens for i in old) // 10)
    summary = Item(f"sum-t{request.turn}-q{wm[-1].seq}", tokens, 1000)
    return CompactionPlan(tuple((i.consumer, i.id) for i in old), summary)


ENOUGH = "tests.support.jobs:enough"


def text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def open_compaction(led: Ledger, sid: str, budget: SessionBudget = BUDGET) -> None:
    """A session whose end_turn enqueues a `compact` job."""
    s = led.open_session(sid, budget)
    s.admit("working_memory", WM_ITEMS)
    assert s.end_turn(0, 8_000).compaction_due


def jobs_of(led: Ledger, sid: str) -> str:
    return led.keyspace.jobs(led.keyspace.partition_of(sid))


def entries_for(led: Ledger, sid: str) -> list[tuple[str, dict[str, str]]]:
    """The entries of a session's partition stream that name that session."""
    out = []
    for eid, raw in led.client.xrange(jobs_of(led, sid), "-", "+") or []:
        fields = {text(k): text(v) for k, v in raw.items()}
        if fields.get("session") == sid:
            out.append((text(eid), fields))
    return out


def session_hash(led: Ledger, sid: str) -> dict[str, str]:
    """The session's hash, with "ep" counted from 1 for this incarnation: a new session
    starts at Redis's clock in ms (its "inc"), each hard reset adds one."""
    raw = led.client.hgetall(led.keyspace.session(sid).session)
    h = {text(k): text(v) for k, v in raw.items()}
    if "ep" in h:
        h["ep"] = str(int(h["ep"]) - int(h["inc"]) + 1)
    return h


def counters(led: Ledger, sid: str, *names: str) -> tuple[str, ...]:
    h = session_hash(led, sid)
    return tuple(h.get(n, "0") for n in names)


def new_worker(led: Ledger, compactor: str = NEVER_ENOUGH, **kw: Any) -> Worker:
    opts: dict[str, Any] = {
        "consumer": f"inproc-{uuid.uuid4().hex[:6]}",
        "claim_idle_ms": 50,
        "poll_interval": 0.01,
        "compactor": compactor,
        **kw,
    }
    return Worker(led, WorkerSettings(**opts), Metrics())


def busy(led: Ledger) -> int:
    """Entries undelivered or pending over every partition of the ledger."""
    c, n = led.client, 0
    for p in range(led.keyspace.partitions):
        stream = led.keyspace.jobs(p)
        if not c.exists(stream):
            continue
        [g] = [g for g in c.xinfo_groups(stream) if text(g["name"]) == GROUP] or [None]
        if g is None:  # no group (yet): every entry waits
            n += int(c.xlen(stream))
            continue
        n += int(g["pending"])
        last = text(g["last-delivered-id"])
        n += len(c.xrange(stream, f"({last}", "+") or [])
    return n


def drain(led: Ledger, worker: Worker, timeout: float = 20.0) -> None:
    """Poll in this thread until nothing is undelivered or pending."""
    worker.ensure_groups()
    deadline = time.monotonic() + timeout
    while busy(led):
        assert time.monotonic() < deadline, f"not drained: {busy(led)} jobs left"
        if not worker.poll_once():
            time.sleep(0.02)


def forget_outcome(led: Ledger, sid: str, op_id: str, timeout: float = 15.0) -> int:
    """Make the session drop the stored outcome of `op_id`, as time does: once the op
    retention has passed, a call of another op id moves the current outcome generation
    to the previous one, and the next rotation (or the previous one's TTL) drops it.
    Returns the number of calls made.
    The session's items and compaction state are left as they were (each call reserves
    one scratchpad token and voids it)."""
    s = led.session(sid)
    deadline = time.monotonic() + timeout
    n = 0
    while stored_outcome(led, sid, op_id):
        assert time.monotonic() < deadline, f"{op_id} still stored after {n} calls"
        rid = f"filler-{n}"
        s.reserve("scratchpad", rid, 1, lease_ms=60_000)
        s.void(rid)
        n += 1
        time.sleep(0.05)  # past the retention, the next call rotates the generations
    return n


def stored_outcome(led: Ledger, sid: str, op_id: str) -> bool:
    """Whether either outcome generation of the session keeps `op_id`."""
    return any(key == op_key(op_id) for key, _ in stored_fingerprints(led, sid))


def op_key(op_id: str) -> str:
    """The key an op id's outcome is stored under (its bucket's field holds the rest)."""
    return outcome_key(op_id)[1]


def stored_fingerprints(led: Ledger, sid: str) -> list[tuple[str, str]]:
    """(op key, fingerprint) of every outcome the session keeps, both generations: an
    op id's key is :func:`op_key` of it."""
    keys = led.keyspace.session(sid)
    return [
        (op, fp)
        for k in (keys.outcomes, keys.outcomes_old)
        for bucket in led.client.hvals(k)
        for op, fp, _ in stored_outcomes(text(bucket))
    ]


# --- Redis out of memory ----------------------------------------------------------------


def set_maxmemory(client: redis.Redis, limit: int) -> None:
    client.config_set("maxmemory", str(limit))


@contextlib.contextmanager
def out_of_memory(client: redis.Redis) -> Iterator[None]:
    """maxmemory far below what the server uses (policy noeviction): every command that
    may grow memory is refused with OOM until the block ends."""
    set_maxmemory(client, 1)
    try:
        yield
    finally:
        set_maxmemory(client, 0)


def wait_until(pred: Callable[[], bool], timeout: float, what: str, step: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class LoopThread:
    """Worker.run in a thread; what escapes it is kept (the loop must never die)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.stop_event = threading.Event()
        self.escaped: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.worker.run(self.stop_event)
        except BaseException as exc:
            self.escaped.append(exc)

    def __enter__(self) -> LoopThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.escaped

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(20)
        assert not self.thread.is_alive(), "the worker loop did not stop"
        if self.escaped:
            raise AssertionError("the worker loop died") from self.escaped[0]


def metric(worker: Worker, name: str, **labels: str) -> float:
    return worker.metrics.registry.get_sample_value(name, labels) or 0.0


def open_resets(led: Ledger, sids: list[str]) -> list[tuple[str, str]]:
    """Open sessions (no items) and append one hard_reset job each, as the scripts
    write them; returns (session id, entry id) pairs."""
    out = []
    for sid in sids:
        epoch = led.open_session(sid, BUDGET).epoch
        entry = JobEntry(JobKind.HARD_RESET, sid, epoch, reason="test", op="x")
        out.append((sid, text(led.client.xadd(jobs_of(led, sid), entry.to_fields()))))  # type: ignore[arg-type]
    return out
