"""Full benchmark of the ledger against the round-trip floor and two conventional implementations.

    python -m bench.bench_full [--quick] [--json] [--duration S] [--procs 1,8,32]

One run, on one redis-server it starts itself, measures:

1. A matrix of rows: operation x client mode x worker processes x session layout, each
   time-boxed. Operations (OPS): the ledger's hot paths, the round-trip floor (a bare
   EVALSHA of ``return 1``) and the same single-item admission written with
   WATCH/MULTI/EXEC and with a redis-py Lock (bench/alternatives.py). Modes: sync (one
   blocking call at a time per process), asyncio (K calls in flight per process) and
   pipelined (Ledger.run_many of B calls; admit_raw: a bare MULTI/EXEC of the same calls,
   pre-built; the alternatives cannot be pipelined). Processes: 1, 8, 32 (spawned once);
   with several, all on one shared session or each on its own (spread). Per row: ops/s,
   p50/p99 of one operation (pipelined: of its batch), ratios to the floor and to each
   alternative, server time from INFO commandstats, commands per operation, static
   redis.call( sites, client CPU per operation, and a consistency check afterwards.
2. Server time per call with one idle client: bench_core's phases, median of reps.
3. Memory of one session (MEMORY USAGE of its keys): fresh, after 40 typical turns, and
   with op retention shortened to 1 s after 40 and 400 turns, each also after an idle
   pause longer than the retention: the outcomes are bounded by time, not length.
4. The targets, as ratios, with PASS/MISS.

--quick: tiny sizes for CI (200 operations per row, 1 and 2 processes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import math
import multiprocessing as mp
import queue
import random
import subprocess
import sys
import time
import traceback
import uuid
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from bench import alternatives as alt
from bench.bench_core import (
    BENCH_BUDGET,
    LEASE_MS,
    MEMORY_BUDGET,
    Bench,
    cpu_parts_table,
    prelude_sites,
    server_table,
    static_redis_calls,
)
from bench.common import (
    CLK_TCK,
    ROOT,
    commandstats,
    cpu_seconds,
    cpu_ticks,
    emit,
    environment,
    machine,
    steal_during,
)
from bench.common import table as print_table
from ledger import AsyncLedger, Item, Ledger, scripts
from ledger.client import Session
from ledger.core import SessionCore
from ledger.protocol import Call

# --- what is measured ------------------------------------------------------------------

# op -> (what one operation is, Lua scripts it runs)
OPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "floor": ("bare EVALSHA of `return 1` through redis-py (the round-trip floor)", ()),
    "admit_1": ('session.admit("retrieval", [Item(id, 1)])', ("admit",)),
    "admit_raw": ("bare EVALSHA of the admit script, 1 item, args pre-built (no library)",
                  ("admit",)),
    "admit_16": ('session.admit("retrieval", [16 x Item(id, 1)])', ("admit",)),
    "begin_turn": ("session.begin_turn(working_set=6000)", ("begin_turn",)),
    "release": ('session.release("retrieval", [id]), admitted before the row', ("release",)),
    "reserve_settle": ("session.reserve(1 token) then session.settle(): 2 calls",
                       ("reserve", "settle")),
    "watch": ("WATCH, HMGET, MULTI/HINCRBY/HSET/EXEC admit of 1 item, retried on WatchError", ()),
    "lock": ("redis-py Lock, HMGET, MULTI/HINCRBY/HSET/EXEC, unlock: admit of 1 item", ()),
}  # fmt: skip
ALTERNATIVES = ("watch", "lock")
# The bench owner's token, the same in every process (a fixed one: the bench is its only user)
TOKEN = "b" * 32
LEDGER_OPS = ("admit_1", "admit_16", "begin_turn", "release", "reserve_settle")
MODES = ("sync", "asyncio", "pipelined")
MODE_OPS: dict[str, tuple[str, ...]] = {
    "sync": ("floor", "admit_raw", *LEDGER_OPS, *ALTERNATIVES),
    "asyncio": ("floor", "admit_raw", *LEDGER_OPS, *ALTERNATIVES),
    "pipelined": ("floor", "admit_raw", "admit_1", "admit_16"),
}
CALLS_PER_OP = {"reserve_settle": 2}
# Ceilings (ops/s, whole row) used to size the state a row consumes (items to release,
# pre-built pipelined calls); a worker that runs out stops early and is flagged.
ONLY_SINGLE_PROCESS = ("admit_raw",)  # a reference for the library's client cost, P=1 only
STATE_RATE = {("release", "*"): 12_000, ("admit_raw", "*"): 10_000,
              ("admit_raw", "pipelined"): 30_000}  # fmt: skip
# Every bench client: the ledger's settings but timeouts that an overloaded 2-core machine
# (32 processes) does not hit: a timeout here would measure the timeout, not the ledger;
# so no retries either.
CLIENT_TIMEOUTS = {"socket_timeout": 120.0, "connect_timeout": 60.0, "retry_attempts": 1}
UNCAPPED = 10**9
DRAIN_S = 2.0  # asyncio: seconds after the time box before operations in flight are cancelled
EXCLUDED_STATS = ("info", "config", "client", "hello", "ping", "script", "flushdb", "command")
FLOOR_SCRIPT = "return 1"
FLOOR_SHA = hashlib.sha1(FLOOR_SCRIPT.encode()).hexdigest()
WORKING_SET = 6_000
TURN_KEEP = 2  # a turn's chunks and tool result are released two turns later
ALT_WINDOW = BENCH_BUDGET.window


@dataclass(frozen=True)
class Plan:
    quick: bool
    procs: tuple[int, ...]
    duration: float  # seconds per row (time box)
    ops_per_row: int | None  # --quick: a fixed number of operations per row instead
    concurrency: int  # asyncio: calls in flight per process
    batch: int  # pipelined: calls per pipeline
    calib_n: int
    calib_reps: int
    turns: tuple[int, int]  # memory: a typical session's length, and the long one
    after_pause_turns: int
    retention_s: int
    modes: tuple[str, ...] = MODES


def make_plan(a: argparse.Namespace) -> Plan:
    if a.quick:
        plan = Plan(True, (1, 2), 30.0, 200, 4, 8, 50, 1, (10, 40), 10, 1)
    else:
        plan = Plan(False, (1, 8, 32), 1.25, None, 8, 32, 500, 5, (40, 400), 20, 1)
    over = {"procs": tuple(int(x) for x in a.procs.split(",")) if a.procs else plan.procs}
    return Plan(**{**asdict(plan), **over, "duration": a.duration or plan.duration})


@dataclass
class RowSpec:
    row: int
    mode: str
    op: str
    procs: int
    layout: str  # "shared" (one session for all processes) or "spread" (one each)
    url: str
    prefix: str
    duration: float
    cap: int  # operations per worker at most
    concurrency: int
    batch: int

    @property
    def sessions(self) -> int:
        return 1 if self.layout == "shared" else self.procs

    def session_id(self, worker: int) -> str:
        return f"r{self.row}" if self.layout == "shared" else f"r{self.row}.w{worker}"

    def alt_key(self, worker: int) -> str:
        return f"{self.prefix}:alt:{self.session_id(worker)}"


def worker_cap(plan: Plan, op: str, mode: str, procs: int) -> int:
    if plan.ops_per_row is not None:
        return math.ceil(plan.ops_per_row / procs)
    rate = STATE_RATE.get((op, mode)) or STATE_RATE.get((op, "*"))
    if rate is None:
        return UNCAPPED
    return math.ceil(rate * plan.duration * 1.1 / procs)


# --- worker processes ------------------------------------------------------------------

Step = Callable[[int], Any]  # k -> a reply, or (asyncio) an awaitable of one


def _retries(res: Any) -> int:
    """An alternative's retries (it must have admitted the item); 0 for the ledger."""
    if not isinstance(res, alt.AltResult):
        return 0
    if res.status != "ok":
        raise RuntimeError(f"alternative admission returned {res.status}")
    return res.retries


def prebuilt_admits(s: SessionCore, tag: str, ks: range) -> list[Call[Any]]:
    """One-item admit calls, item ids '<tag>.<k>' for k in ks."""
    return [s.admit_call("retrieval", [Item(f"{tag}.{k}", 1)]) for k in ks]


def prepare(spec: RowSpec, w: int, led: Ledger) -> list[Call[Any]]:
    """What a worker's row needs before it starts, written with a sync client in every
    mode: its session (or the alternative's hash), the items a release row gives back,
    the scripts loaded; returns the pre-built calls of an admit_raw row."""
    r: redis.Redis = led.client  # type: ignore[assignment]
    tag = f"w{w}"
    r.script_load(FLOOR_SCRIPT)
    if spec.op in ALTERNATIVES:
        alt.open_session(r, spec.alt_key(w), ALT_WINDOW)
        return []
    # one owner for every process of a shared session, with one owner token: the bench
    # measures the scripts, and a begin_turn by the owner of the open turn (its token
    # shown) ends it (docs/agent.md#turn-leases)
    s = led.open_session(spec.session_id(w), BENCH_BUDGET, owner="bench", owner_token=TOKEN)
    r.script_load(led._scripts["admit"].script)
    if spec.op == "release":
        ids = [f"{tag}.{k}" for k in range(-spec.concurrency, spec.cap)]
        for lo in range(0, len(ids), 1000):
            s.admit("retrieval", [Item(i, 1) for i in ids[lo : lo + 1000]])
    if spec.op != "admit_raw":
        return []
    if spec.mode == "pipelined":  # the same calls, pre-built, in a bare MULTI/EXEC
        n = spec.batch
        return prebuilt_admits(s, tag, range(math.ceil(min(spec.cap, UNCAPPED // 1000) / n) * n))
    return prebuilt_admits(s, tag, range(-spec.concurrency, spec.cap))  # the first warm up


def _evalsha(r: Any, sha: str, c: Call[Any]) -> Any:
    return r.evalsha(sha, len(c.keys), *c.keys, *c.args)


def steps(spec: RowSpec, w: int, s: Any, r: Any, raw: list[Call[Any]]) -> list[Step]:
    """The calls of one operation k, on a sync or an asyncio session and client."""
    tag, op, off = f"w{w}", spec.op, spec.concurrency
    if op in ALTERNATIVES:
        sync = spec.mode != "asyncio"
        impl = (
            (alt.WatchAdmit if sync else alt.AsyncWatchAdmit)(r)
            if op == "watch"
            else ((alt.LockAdmit if sync else alt.AsyncLockAdmit)(r))
        )
        return [lambda k: impl.admit(spec.alt_key(w), f"{tag}.{k}", 1)]
    admit_sha = scripts.sha("admit")
    table: dict[str, list[Step]] = {
        "floor": [lambda k: r.evalsha(FLOOR_SHA, 0)],
        "admit_1": [lambda k: s.admit("retrieval", [Item(f"{tag}.{k}", 1)])],
        "admit_raw": [lambda k: _evalsha(r, admit_sha, raw[k + off])],
        "admit_16": [
            lambda k: s.admit("retrieval", [Item(f"{tag}.{k}.{j}", 1) for j in range(16)])
        ],
        "begin_turn": [lambda k: s.begin_turn(WORKING_SET)],
        "release": [lambda k: s.release("retrieval", [f"{tag}.{k}"])],
        "reserve_settle": [
            lambda k: s.reserve("retrieval", f"{tag}.r{k}", 1, lease_ms=LEASE_MS),
            lambda k: s.settle(f"{tag}.r{k}", 1, f"{tag}.x{k}"),
        ],
    }  # fmt: skip
    return table[op]


def _pipe(r: redis.Redis, sha: str, calls: Any, transaction: bool) -> int:
    with r.pipeline(transaction=transaction) as pipe:
        for keys, args in calls:
            pipe.evalsha(sha, len(keys), *keys, *args)
        pipe.execute()
    return 0


def pipelined(spec: RowSpec, w: int, led: Ledger, raw: list[Call[Any]]) -> Callable[[int], int]:
    """Batch k of B calls in one pipeline: the floor's, run_many's, or admit_raw's (a bare
    MULTI/EXEC of the same calls, pre-built, as run_many sends them)."""
    r: redis.Redis = led.client  # type: ignore[assignment]
    tag, n = f"w{w}", spec.batch
    if spec.op == "floor":
        return lambda k: _pipe(r, FLOOR_SHA, [((), ())] * n, False)
    if spec.op == "admit_raw":
        sha = scripts.sha("admit")
        return lambda k: _pipe(r, sha, [(c.keys, c.args) for c in raw[k * n : (k + 1) * n]], True)
    s = led.session(spec.session_id(w), owner="bench", owner_token=TOKEN)
    size = 16 if spec.op == "admit_16" else 1

    def admit_batch(k: int) -> int:
        led.run_many(
            s.admit_call("retrieval", [Item(f"{tag}.{k}.{i}.{j}", 1) for j in range(size)])
            for i in range(n)
        )
        return 0

    return admit_batch


@dataclass
class Tally:
    ops: int = 0
    retries: int = 0
    errors: int = 0
    first_error: str | None = None
    lat: array = field(default_factory=lambda: array("d"))  # type: ignore[type-arg]
    unfinished: int = 0

    def error(self, exc: BaseException) -> None:
        self.errors += 1
        if self.first_error is None:
            self.first_error = f"{type(exc).__name__}: {exc}"[:300]

    def result(self, t0: float, t1: float, c0: float, c1: float, capped: bool) -> dict[str, Any]:
        return asdict(self) | {"t_start": t0, "t_end": t1, "cpu_s": c1 - c0, "capped": capped,
                               "lat": self.lat.tobytes()}  # fmt: skip


def run_sync_row(spec: RowSpec, w: int, outbox: Any, barrier: Any) -> dict[str, Any]:
    with Ledger.from_url(spec.url, prefix=spec.prefix, **CLIENT_TIMEOUTS) as led:
        raw, unit = prepare(spec, w, led), 1
        if spec.mode == "pipelined":
            op, unit = pipelined(spec, w, led, raw), spec.batch
        else:
            s = None
            if spec.op not in ALTERNATIVES:
                s = led.session(spec.session_id(w), owner="bench", owner_token=TOKEN)
            fs = steps(spec, w, s, led.client, raw)

            def op(k: int) -> int:
                for f in fs:
                    res = f(k)
                return _retries(res)

            op(-1)  # connection, script cache: before the RESETSTAT that follows "ready"
        outbox.put(("ready", w, None))
        barrier.wait(timeout=600)
        tally = Tally()
        cap = math.ceil(spec.cap / unit)  # op calls (pipelined: batches)
        t0, c0 = time.time(), time.process_time()
        deadline = time.perf_counter() + spec.duration
        k = 0
        lat, pc = tally.lat, time.perf_counter
        while k < cap:
            a = pc()
            if a >= deadline:
                break
            try:
                tally.retries += op(k)
            except Exception as exc:
                tally.error(exc)
            else:
                d = pc() - a
                tally.ops += unit
                if unit == 1:
                    lat.append(d)
                else:
                    lat.extend(itertools.repeat(d, unit))
            k += 1
        t1, c1 = time.time(), time.process_time()
        return tally.result(t0, t1, c0, c1, capped=k >= cap and pc() < deadline)


async def run_async_row(spec: RowSpec, w: int, outbox: Any, barrier: Any) -> dict[str, Any]:
    with Ledger.from_url(spec.url, prefix=spec.prefix, **CLIENT_TIMEOUTS) as sync_led:
        raw = prepare(spec, w, sync_led)
    async with contextlib.AsyncExitStack() as stack:
        led = AsyncLedger.from_url(spec.url, prefix=spec.prefix, **CLIENT_TIMEOUTS)
        stack.push_async_callback(led.aclose)
        s = None
        if spec.op not in ALTERNATIVES:
            s = await led.session(spec.session_id(w), owner="bench", owner_token=TOKEN)
        fs = steps(spec, w, s, led.client, raw)

        async def op(k: int) -> int:
            for f in fs:
                res = await f(k)
            return _retries(res)

        await op(-1)  # script cache
        await asyncio.gather(*(led.client.ping() for _ in range(spec.concurrency)))  # K conns
        outbox.put(("ready", w, None))
        barrier.wait(timeout=600)  # blocks the loop: nothing else runs on it meanwhile
        tally = Tally()
        tickets = itertools.count()
        cap = spec.cap
        deadline = time.perf_counter() + spec.duration
        pc = time.perf_counter
        started: dict[int, float] = {}  # lane -> start of its operation in flight

        async def lane(i: int) -> None:
            while True:
                k = next(tickets)
                a = pc()
                if k >= cap or a >= deadline:
                    return
                started[i] = a
                try:
                    tally.retries += await op(k)
                except Exception as exc:
                    tally.error(exc)
                else:
                    tally.lat.append(pc() - a)
                    tally.ops += 1
                del started[i]

        t0, c0 = time.time(), time.process_time()
        lanes = [asyncio.ensure_future(lane(i)) for i in range(spec.concurrency)]
        # Operations in flight at the deadline may finish within DRAIN_S; those still
        # running then are cancelled: not counted as done, their latency so far kept
        # as a lower bound (the row's p99 is then a lower bound too, and flagged).
        _, pending = await asyncio.wait(lanes, timeout=spec.duration + DRAIN_S)
        now = pc()
        unfinished = [now - a for a in started.values()]
        t1, c1 = time.time(), time.process_time()
        give_up = now + 10
        while pending and pc() < give_up:
            # redis-py's asyncio client can swallow a cancellation that lands inside a
            # command (the task goes on, e.g. polling a Lock): cancel again until done
            for t in pending:
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.05)
        tally.lat.extend(unfinished)
        tally.unfinished = len(unfinished)
        return tally.result(t0, t1, c0, c1, capped=tally.ops + tally.errors >= cap)


def worker_main(w: int, inbox: Any, outbox: Any, barriers: dict[int, Any]) -> None:
    """A worker process: runs its part of each row it is sent, until it gets None."""
    outbox.put(("alive", w, None))  # imports done: the parent starts no row before
    while True:
        spec = inbox.get()
        if spec is None:
            return
        try:
            barrier = barriers[spec.procs]
            if spec.mode == "asyncio":
                res = asyncio.run(run_async_row(spec, w, outbox, barrier))
            else:
                res = run_sync_row(spec, w, outbox, barrier)
            outbox.put(("done", w, res))
        except BaseException:
            outbox.put(("error", w, traceback.format_exc()))


class Pool:
    """max(procs) spawned worker processes, started once and reused by every row."""

    def __init__(self, procs: tuple[int, ...]) -> None:
        ctx = mp.get_context("spawn")
        self.size = max(procs)
        self.barriers = {p: ctx.Barrier(p + 1) for p in set(procs)}
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.size)]
        self.timing: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.procs = [ctx.Process(target=worker_main, name=f"bench-worker-{w}", daemon=True,
                                  args=(w, self.inboxes[w], self.outbox, self.barriers))
                      for w in range(self.size)]  # fmt: skip
        for p in self.procs:
            p.start()
        self.collect(self.size, "alive", 600)

    def collect(self, n: int, kind: str, timeout: float) -> dict[int, Any]:
        got: dict[int, Any] = {}
        end = time.monotonic() + timeout
        while len(got) < n:
            try:
                what, w, payload = self.outbox.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"workers did not report {kind} in {timeout:.0f} s") from None
            if what == "error":
                raise RuntimeError(f"worker {w} failed:\n{payload}")
            if what != kind:
                raise RuntimeError(f"worker {w} sent {what}, expected {kind}")
            got[w] = payload
        return got

    def run(
        self, spec: RowSpec, r: redis.Redis, server_pid: int
    ) -> tuple[dict[int, Any], dict[str, Any]]:
        """Set up a row in spec.procs workers, reset the stats, start them together."""
        barrier = self.barriers[spec.procs]
        for w in range(spec.procs):
            self.inboxes[w].put(spec)
        t0 = time.perf_counter()
        try:
            self.collect(spec.procs, "ready", 300)
            r.config_resetstat()
            t1, busy0, srv0 = time.perf_counter(), cpu_ticks()[1], cpu_seconds(server_pid)
            barrier.wait(timeout=120)
            results = self.collect(spec.procs, "done", spec.duration + 300)
            t2, busy1, srv1 = time.perf_counter(), cpu_ticks()[1], cpu_seconds(server_pid)
            self.timing = {"setup_s": t1 - t0, "run_s": t2 - t1}
            self.cpu = {"wall_s": t2 - t1, "machine_busy_s": (busy1 - busy0) / CLK_TCK,
                        "redis_cpu_s": srv1 - srv0}  # fmt: skip
        except BaseException as exc:
            barrier.abort()
            late = []
            with contextlib.suppress(queue.Empty):
                while True:
                    what, w, payload = self.outbox.get(timeout=1)
                    if what == "error":
                        late.append(f"worker {w}:\n{payload}")
            if late:
                raise RuntimeError("\n".join(late)) from exc
            raise
        return results, commandstats(r, EXCLUDED_STATS)

    def close(self) -> None:
        for q in self.inboxes:
            with contextlib.suppress(Exception):
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
        for p in self.procs:  # only our own children, by object
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


# --- one row: summarize ----------------------------------------------------------------


def cpu_shares(cpu: dict[str, float], workers_cpu_s: float) -> dict[str, float]:
    """Redis's CPU, and the CPU of processes outside this benchmark, during a row, in % of
    one core (so up to 100 x nproc). 'other' is the machine's busy time minus the
    server's and the workers' (the parent only waits); jiffy-granular, so approximate."""
    wall = max(cpu.get("wall_s", 0.0), 1e-9)
    other = cpu.get("machine_busy_s", 0.0) - cpu.get("redis_cpu_s", 0.0) - workers_cpu_s
    return {
        "redis_cpu_pct": 100 * cpu.get("redis_cpu_s", 0.0) / wall,
        "other_cpu_pct": max(0.0, 100 * other / wall),
    }


def pct(sorted_xs: list[float], q: float) -> float:
    if not sorted_xs:
        return 0.0
    i = min(len(sorted_xs) - 1, max(0, math.ceil(q * len(sorted_xs)) - 1))
    return sorted_xs[i]


NESTED = {"watch": alt.WATCH_NESTED, "lock": alt.LOCK_NESTED}


def server_figures(op: str, cmds: dict[str, tuple[int, int]], ops: int) -> dict[str, Any]:
    """Server time of a row from its commandstats. A ledger operation's is its EVALSHA's
    (a script's usec includes the commands it calls); an alternative's, that of its
    top-level commands (those in NESTED run inside EXEC or Lock's release script)."""
    nested = NESTED.get(op)
    top = {
        c: cu for c, cu in cmds.items() if (c == "evalsha" if nested is None else c not in nested)
    }
    ev_calls, ev_usec = cmds.get("evalsha", (0, 0))
    top_calls, top_usec = sum(c for c, _ in top.values()), sum(u for _, u in top.values())
    ops = ops or 1
    return {
        "usec_per_call": (ev_usec / ev_calls if ev_calls else 0.0)
        if nested is None
        else top_usec / ops,
        "usec_per_op": top_usec / ops,
        "evalsha_calls": ev_calls,
        "commands_per_op": top_calls / ops,
        "all_commands": {c: v[0] for c, v in cmds.items()},
        "naive_usec_sum_per_op": sum(u for _, u in cmds.values()) / ops,
    }


def summarize(spec: RowSpec, results: dict[int, Any], stats: dict[str, Any]) -> dict[str, Any]:
    ops = sum(r["ops"] for r in results.values())
    t0 = min(r["t_start"] for r in results.values())
    t1 = max(r["t_end"] for r in results.values())
    lat: list[float] = []
    for r in results.values():
        a = array("d")
        a.frombytes(r["lat"])
        lat.extend(a)
    lat.sort()
    wall = max(t1 - t0, 1e-9)
    static = static_redis_calls()
    scripts = OPS[spec.op][1]
    return {
        "mode": spec.mode,
        "op": spec.op,
        "procs": spec.procs,
        "layout": spec.layout,
        "sessions": spec.sessions,
        "concurrency": spec.concurrency if spec.mode == "asyncio" else 1,
        "batch": spec.batch if spec.mode == "pipelined" else 1,
        "ops": ops,
        "seconds": wall,
        "ops_per_s": ops / wall,
        "p50_ms": pct(lat, 0.50) * 1e3,
        "p99_ms": pct(lat, 0.99) * 1e3,
        "cpu_us_per_op": sum(r["cpu_s"] for r in results.values()) / ops * 1e6 if ops else 0.0,
        "retries_per_op": sum(r["retries"] for r in results.values()) / ops if ops else 0.0,
        "errors": sum(r["errors"] for r in results.values()),
        "first_error": next((r["first_error"] for r in results.values() if r["first_error"]), None),
        "capped_workers": sum(1 for r in results.values() if r["capped"]),
        "unfinished": sum(r["unfinished"] for r in results.values()),
        "calls_per_op": CALLS_PER_OP.get(spec.op, 1) if spec.op not in ALTERNATIVES else None,
        "static_redis_call": {f"{s}.lua": static[f"{s}.lua"] for s in scripts}
        | (  # the sites in the part of _common.lua prepended to the row's scripts
            {"_common.lua": max(prelude_sites(f"{s}.lua") for s in scripts)} if scripts else {}
        ),
        "server": server_figures(spec.op, stats, ops),
    }


def check_row(spec: RowSpec, led: Ledger) -> tuple[list[str], int]:
    """Consistency after the row (the ledger's audit, or used == sum of items), and the
    largest number of fields a session hash of the row ended with."""
    r: redis.Redis = led.client  # type: ignore[assignment]
    ids = sorted({spec.session_id(w) for w in range(spec.procs)})
    if spec.op == "floor":
        return [], 0
    if spec.op in ALTERNATIVES:
        keys = [f"{spec.prefix}:alt:{i}" for i in ids]
        return [p for k in keys for p in alt.check(r, k)], max(int(r.hlen(k)) for k in keys)
    problems = []
    fields = max(int(r.hlen(led.keyspace.session(i).session)) for i in ids)
    for i in ids:
        rep = led.audit(i)
        problems += [f"{i}: {p}" for p in rep.problems]
        if rep.overdue:
            problems.append(f"{i}: overdue {rep.overdue[:3]}")
    return problems, fields


def rows_plan(plan: Plan) -> list[tuple[str, str, int, str]]:
    out = []
    for mode in plan.modes:
        for p in plan.procs:
            for op in MODE_OPS[mode]:
                if op in ONLY_SINGLE_PROCESS and p != 1:
                    continue
                layouts = ("shared",) if p == 1 or op == "floor" else ("shared", "spread")
                out += [(mode, op, p, lay) for lay in layouts]
    return out


def add_ratios(rows: list[dict[str, Any]]) -> None:
    def find(mode: str, op: str, p: int, layout: str) -> dict[str, Any] | None:
        for r in rows:
            if (r["mode"], r["op"], r["procs"]) == (mode, op, p) and (
                op == "floor" or r["layout"] == layout
            ):
                return r
        return None

    for r in rows:
        floor = find(r["mode"], "floor", r["procs"], "shared")
        r["vs_floor"] = r["ops_per_s"] / floor["ops_per_s"] if floor else None
        for a in ALTERNATIVES:
            ref_mode = r["mode"] if r["mode"] in ("sync", "asyncio") else "sync"
            ref = find(ref_mode, a, r["procs"], r["layout"])
            r[f"vs_{a}"] = r["ops_per_s"] / ref["ops_per_s"] if ref else None
            r[f"vs_{a}_mode"] = ref_mode if ref else None


def run_matrix(
    plan: Plan, url: str, server_pid: int, led: Ledger, progress: Callable[[str], None]
) -> list[Any]:
    r: redis.Redis = led.client  # type: ignore[assignment]
    todo = rows_plan(plan)
    rows: list[dict[str, Any]] = []
    t = time.perf_counter()
    pool = Pool(plan.procs)
    try:
        progress(f"started {pool.size} worker processes (spawn) in {time.perf_counter() - t:.1f} s")
        for i, (mode, op, p, layout) in enumerate(todo):
            spec = RowSpec(
                i, mode, op, p, layout, url, led.keyspace.prefix,
                plan.duration, worker_cap(plan, op, mode, p), plan.concurrency, plan.batch,
            )  # fmt: skip
            results, stats = pool.run(spec, r, server_pid)
            row = summarize(spec, results, stats)
            row |= cpu_shares(pool.cpu, sum(x["cpu_s"] for x in results.values()))
            c0 = time.perf_counter()
            row["check"], row["session_fields_max"] = check_row(spec, led)
            r.flushdb()
            row["timing"] = pool.timing | {"check_s": time.perf_counter() - c0}
            rows.append(row)
            progress(
                f"[{i + 1}/{len(todo)}] {mode:9} {op:14} P={p:<2} {layout:6} "
                f"{row['ops_per_s']:>9,.0f} ops/s  p99 {row['p99_ms']:7.2f} ms  "
                f"srv {row['server']['usec_per_call']:6.1f} µs/call  "
                + "/".join(f"{v:.1f}" for v in row["timing"].values())
                + " s setup/run/check"
                + (f"  ERRORS {row['errors']}: {row['first_error']}" if row["errors"] else "")
                + (f"  CHECK {row['check'][:2]}" if row["check"] else "")
            )
    finally:
        pool.close()
    add_ratios(rows)
    progress(f"matrix: {len(rows)} rows in {time.perf_counter() - t:.1f} s")
    return rows


# --- server time with one idle client (bench_core's phases) ------------------------------

CALIBRATION = (
    "return1",
    "prelude_return1",
    "admit_commands",
    "admit_1",
    "admit_16",
    "return1_warm",
    "admit_commands_warm",
    "admit_1_warm",
)


def calibrate(led: Ledger, n: int, reps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Server time per call with one idle client, and the client CPU of the pieces of one
    ledger call without I/O: bench_core's phases and cpu_parts."""
    b = Bench(led, n, reps)
    return b.server(CALIBRATION), b.cpu_parts()


# --- memory ----------------------------------------------------------------------------


class TypicalSession:
    """A session driven like an agent's: begin_turn, 12-18 chunks of ~400 tokens (one
    admit each), a tool result, a recall span, end_turn, and the release of the chunks
    and tool result of the turn TURN_KEEP turns back."""

    def __init__(self, s: Session, seed: int) -> None:
        self.s = s
        self.rng = random.Random(seed)
        self.held: deque[tuple[list[Item], str, int]] = deque()
        self.turns = 0
        self.calls = 1  # open
        self.started = time.perf_counter()

    def turn(self) -> None:
        s, rng, t = self.s, self.rng, self.turns
        started = s.begin_turn(WORKING_SET)
        chunks = [Item(f"c{t}.{j}", rng.randint(350, 450)) for j in range(rng.randint(12, 18))]
        for it in chunks:
            s.admit("retrieval", [it])
        tool = rng.randint(300, 1_200)
        s.admit_tool_result(f"call{t}", tool, b"x" * (tool * 4))
        s.record_span(started.turn, "recall", rng.randint(2_000, 4_000), 200)
        self.held.append((chunks, f"call{t}", tool))
        prompt = MEMORY_BUDGET.system_prompt + MEMORY_BUDGET.tool_framing
        prompt += sum(sum(c.tokens for c in ch) + tt for ch, _, tt in self.held)
        s.end_turn(started.turn, min(prompt, MEMORY_BUDGET.window))
        self.calls += 4 + len(chunks)
        if len(self.held) > TURN_KEEP:
            old, call, _ = self.held.popleft()
            s.release("retrieval", [c.id for c in old])
            s.release("scratchpad", [call])
            self.calls += 2
        self.turns += 1

    def run(self, n: int) -> None:
        for _ in range(n):
            self.turn()


def session_memory(led: Ledger, s: Session) -> dict[str, Any]:
    """MEMORY USAGE of a session's own keys (hash, outcomes, spills), and of the
    partition keys it shares."""
    r: redis.Redis = led.client  # type: ignore[assignment]

    def usage(*keys: str) -> int:
        return sum(int(r.memory_usage(k, samples=0) or 0) for k in keys)

    d = Bench(led, 1, 1).describe(s.keys.session)
    spill = [k for k in (s.keys.spills, s.keys.spilled) if r.exists(k)]
    d["session_hash_bytes"] = d["bytes"]
    d["outcome_bytes"] = usage(s.keys.outcomes, s.keys.outcomes_old)
    d["spill_keys"] = len(spill)
    d["bytes"] = d["session_hash_bytes"] + d["outcome_bytes"] + usage(*spill)
    d["partition_keys_bytes"] = usage(s.keys.deadlines, s.keys.jobs)
    return d


def what_if_small(r: redis.Redis, key: str) -> dict[str, Any]:
    """The fresh hash's fields whose names and values fit hash-max-listpack-value,
    copied to a scratch key: what the encoding alone costs."""
    limit = int(r.config_get("hash-max-listpack-value")["hash-max-listpack-value"])
    everything = r.hgetall(key)
    fields = {f: v for f, v in everything.items() if len(f) <= limit and len(v) <= limit}
    tmp = f"{key}:whatif"
    r.hset(tmp, mapping=fields)  # type: ignore[arg-type]
    try:
        return {
            "bytes": int(r.memory_usage(tmp, samples=0) or 0),
            "fields": len(fields),
            "encoding": r.object("encoding", tmp).decode(),
            "dropped_fields": sorted(f.decode() for f in everything if f not in fields),
        }
    finally:
        r.delete(tmp)


def memory(url: str, plan: Plan, progress: Callable[[str], None]) -> dict[str, Any]:
    (short, long_), ret, k = plan.turns, plan.retention_s, plan.after_pause_turns
    base = f"bm{uuid.uuid4().hex[:8]}"
    out: dict[str, Any] = {"turns": [short, long_], "retention_s": ret, "rows": {}}

    def snap(name: str, led: Ledger, ts: TypicalSession) -> None:
        out["rows"][name] = session_memory(led, ts.s) | {
            "turns": ts.turns, "ledger_calls": ts.calls, "op_retention_s":
            led.settings.op_retention_seconds, "elapsed_s": time.perf_counter() - ts.started,
        }  # fmt: skip

    with Ledger.from_url(url, prefix=f"{base}a", **CLIENT_TIMEOUTS) as led:
        fresh = TypicalSession(led.open_session("fresh", MEMORY_BUDGET), 0)
        snap("fresh", led, fresh)
        out["what_if_fresh_small_fields"] = what_if_small(led.client, fresh.s.keys.session)  # type: ignore[arg-type]
        typ = TypicalSession(led.open_session("typical", MEMORY_BUDGET), 1)
        typ.run(short)
        snap(f"{short}_turns", led, typ)
        typ.run(long_ - short)
        snap(f"{long_}_turns", led, typ)
        progress(f"memory: default op retention ({led.settings.op_retention_seconds} s) done")
    with Ledger.from_url(
        url, prefix=f"{base}b", op_retention_seconds=ret, **CLIENT_TIMEOUTS
    ) as led:
        a = TypicalSession(led.open_session("short", MEMORY_BUDGET), 2)
        b = TypicalSession(led.open_session("long", MEMORY_BUDGET), 3)
        a.run(short)
        snap(f"{short}_turns_retention_{ret}s", led, a)
        b.run(long_)
        snap(f"{long_}_turns_retention_{ret}s", led, b)
        time.sleep(out.setdefault("pause_s", ret + 0.2))
        a.run(k)
        b.run(k)
        snap(f"{short}_turns_pause_{k}_more_retention_{ret}s", led, a)
        snap(f"{long_}_turns_pause_{k}_more_retention_{ret}s", led, b)
        out["after_pause_turns"] = k
    progress(f"memory: op retention {ret} s done")
    return out


# --- targets ---------------------------------------------------------------------------


def targets(res: dict[str, Any], plan: Plan) -> list[dict[str, Any]]:
    rows, cal, mem = res["rows"], res["calibration"], res["memory"]
    pmax = max(plan.procs)
    out: list[dict[str, Any]] = []

    def add(name: str, measured: float | None, limit: float, kind: str, how: str) -> None:
        ratio = None if measured is None else measured / limit
        ok = ratio is not None and (ratio <= 1 if kind == "<=" else ratio >= 1)
        verdict = "n/a" if ratio is None else "PASS" if ok else "MISS"
        out.append({"target": name, "measured": measured, "limit": limit, "kind": kind,
                    "ratio": ratio, "verdict": verdict, "how": how})  # fmt: skip

    def row(mode: str, op: str, p: int, layout: str = "shared") -> dict[str, Any] | None:
        return next((r for r in rows if (r["mode"], r["op"], r["procs"], r["layout"])
                     == (mode, op, p, layout)), None)  # fmt: skip

    a1, a16 = cal["admit_1"]["usec_per_call"], cal["admit_16"]["usec_per_call"]
    floor, cmds = cal["return1"]["usec_per_call"], cal["admit_commands"]["usec_per_call"]
    add("single-item admit, server µs (median)", a1, 10.0, "<=",
        f"EVALSHA usec/calls, median of {plan.calib_reps} x {plan.calib_n} calls, one client; "
        f"on this machine `return 1` takes {floor:.1f} µs and admit's three commands alone "
        f"{cmds:.1f} µs (admit_commands), so admit's own Lua is {a1 - cmds:.1f} µs. Back to "
        f"back (warm): return 1 {cal['return1_warm']['usec_per_call']:.1f}, commands "
        f"{cal['admit_commands_warm']['usec_per_call']:.1f}, admit "
        f"{cal['admit_1_warm']['usec_per_call']:.1f} µs")  # fmt: skip
    add("batch of 16 vs single (server time)", a16 / a1 if a1 else None, 3.0, "<=",
        f"admit_16 {a16:.1f} µs / admit_1 {a1:.1f} µs")  # fmt: skip
    for mode in plan.modes:
        for ref_op, ref_name in (("floor", "bare EVALSHA return 1"),
                                 ("admit_raw", "bare EVALSHA of admit, same args")):  # fmt: skip
            led_row, ref = row(mode, "admit_1", 1), row(mode, ref_op, 1)
            m = led_row["cpu_us_per_op"] / ref["cpu_us_per_op"] if led_row and ref else None
            how = "rows not run"
            if led_row and ref:
                wall = 1e6 / led_row["ops_per_s"], 1e6 / ref["ops_per_s"]
                how = (f"client CPU/op, P=1: admit_1 {led_row['cpu_us_per_op']:.0f} µs / "
                       f"{ref_op} {ref['cpu_us_per_op']:.0f} µs; wall/op "
                       f"{wall[0]:.0f} / {wall[1]:.0f} µs")  # fmt: skip
            add(f"library client cost vs {ref_name} ({mode})", m, 1.25, "<=", how)
    for mode in ("sync", "asyncio"):
        lr, wr = row(mode, "admit_1", pmax), row(mode, "watch", pmax)
        m = lr["ops_per_s"] / wr["ops_per_s"] if lr and wr else None
        how = (f"admit_1 {lr['ops_per_s']:,.0f} ops/s / WATCH {wr['ops_per_s']:,.0f} ops/s"
               if lr and wr else "rows not run")  # fmt: skip
        add(f"{pmax} processes, one session, vs WATCH/MULTI ({mode})", m, 25.0, ">=", how)
    for mode in plan.modes:
        lr = row(mode, "admit_1", pmax)
        how = "row not run"
        if lr:
            # Little's law: with N operations always in flight, mean latency = N / throughput
            n = pmax * {"sync": 1, "asyncio": plan.concurrency, "pipelined": plan.batch}[mode]
            how = (f"p50 {lr['p50_ms']:.2f} ms at {lr['ops_per_s']:,.0f} ops/s; {n} in flight "
                   f"-> mean = {n / lr['ops_per_s'] * 1e3:.1f} ms (Little's law)")  # fmt: skip
            fl = row(mode, "floor", pmax)
            if fl:
                how += f"; the floor (bare EVALSHA return 1) has p99 {fl['p99_ms']:.1f} ms here"
        p99 = lr["p99_ms"] if lr else None
        add(f"{pmax} processes, one session, admit_1 p99 ms ({mode})", p99, 10.0, "<=", how)
    mrows = mem["rows"]
    add("freshly opened session, bytes", mrows["fresh"]["bytes"], 1024.0, "<=",
        f"MEMORY USAGE of its keys; {mrows['fresh']['fields']} fields, "
        f"{mrows['fresh']['encoding']}")  # fmt: skip
    short, long_ = mem["turns"]
    k, ret = mem["after_pause_turns"], mem["retention_s"]
    sa = mrows[f"{short}_turns_pause_{k}_more_retention_{ret}s"]
    sb = mrows[f"{long_}_turns_pause_{k}_more_retention_{ret}s"]
    add(f"journal bounded: {long_} vs {short} turns (retention {ret} s)",
        sb["bytes"] / sa["bytes"], 1.25, "<=",
        f"{sb['bytes']:,} B / {sa['bytes']:,} B, both after a {mem['pause_s']:.1f} s pause "
        f"and {k} more turns; outcomes kept {sb['fields_by_class'].get('outcomes', 0)} vs "
        f"{sa['fields_by_class'].get('outcomes', 0)}")  # fmt: skip
    return out


# --- output ----------------------------------------------------------------------------


def _git(*args: str) -> str:
    """A read-only git query in the repository."""
    proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    return proc.stdout.strip()


def git_commit() -> str:
    try:
        head, dirty = _git("rev-parse", "--short", "HEAD"), _git("status", "--porcelain")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" (+ uncommitted changes)" if dirty else "")


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _notes(r: dict[str, Any], capped_matters: bool) -> str:
    notes = [f"retries/op {r['retries_per_op']:.2f}"] if r["retries_per_op"] else []
    if r["capped_workers"] and capped_matters:
        notes.append(f"[yellow]pre-built state ran out: {r['capped_workers']}/{r['procs']} "
                     "workers stopped early[/yellow]")  # fmt: skip
    if r["unfinished"]:
        notes.append(f"[yellow]{r['unfinished']} still running {DRAIN_S:g} s after the "
                     "time box: cancelled, p99 is a lower bound[/yellow]")  # fmt: skip
    if r["errors"]:
        notes.append(f"[red]errors {r['errors']}[/red]")
    if r["op"] != "floor":
        notes.append(f"[red]check: {r['check'][0]}[/red]" if r["check"] else "check ok")
    if r["op"] == "begin_turn":
        notes.append(f"hash {r['session_fields_max']:,} fields at end")
    if r["mode"] == "pipelined" and r["op"] != "floor":
        notes.append("x WATCH/Lock vs sync")
    return ", ".join(notes)


MATRIX_COLUMNS = ["op", "P", "sess", "ops", "ops/s", "p50\nms", "p99\nms", "x floor", "x WATCH",
                  "x Lock", "srv µs\n/call", "srv µs\n/op", "cmds\n/op", "redis.call(\nsites",
                  "CPU µs\n/op", "redis\nCPU %", "other\nCPU %", "notes"]  # fmt: skip
MODE_TITLES = {
    "sync": "one blocking call at a time per process",
    "asyncio": "AsyncLedger, asyncio.gather of K={concurrency} per process",
    "pipelined": "Ledger.run_many of B={batch} calls, one MULTI/EXEC (admit_raw: the same of "
    "pre-built EVALSHA); latency = batch",
}
LEGEND = (
    "x floor / WATCH / Lock: ops/s over that row's at the same mode, processes and layout. "
    "srv µs/call: EVALSHA usec/calls (a script's includes its commands); WATCH/Lock rows: "
    "the usec of the top-level commands / ops (the naive sum is in the JSON). cmds/op: "
    "top-level commands per operation. redis.call( sites: the script(s) + its prelude. CPU "
    "µs/op: process_time of the workers / ops. redis / other CPU %: the server's, and the "
    "machine's busy time outside the server and the workers (% of one core). The "
    "alternatives only admit one item: their ratios mean something for admit_1. Redis's usec "
    "is wall time (busy clients deschedule it): the one-idle-client table is the clean one."
)


def print_report(res: dict[str, Any]) -> None:
    from rich.console import Console

    env, p, mem = res["env"], res["params"], res["memory"]
    print(
        f"ledger full bench  commit {res['git']}  total {res['elapsed_s']:.0f} s\n{machine(env)}"
        f"; CPU used by other processes on the host during the rows: mean "
        f"{res['other_cpu']['mean_pct']:.0f} %, max {res['other_cpu']['max_pct']:.0f} % of one "
        f"core (of {env['nproc'] * 100} %)\nrows: {p['duration']} s time box each"
        + (f", {p['ops_per_row']} ops per row" if p["ops_per_row"] else "")
        + f"; processes {p['procs']} (spawn); asyncio K={p['concurrency']} calls in flight "
        f"per process; pipeline B={p['batch']} calls; sessions: shared = one for all "
        "processes, spread = one per process"
    )
    for mode in p["modes"]:
        rows = []
        for r in (r for r in res["rows"] if r["mode"] == mode):
            st, srv = r["static_redis_call"], r["server"]
            sites = "+".join(str(v) for k, v in st.items() if k != "_common.lua")
            sites = f"{sites} +{st['_common.lua']}" if st else "0" if r["op"] == "floor" else "-"
            rows.append([
                r["op"], str(r["procs"]), str(r["sessions"]), f"{r['ops']:,}",
                f"{r['ops_per_s']:,.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
                _f(r["vs_floor"]), _f(r["vs_watch"]), _f(r["vs_lock"]),
                f"{srv['usec_per_call']:.1f}", f"{srv['usec_per_op']:.1f}",
                f"{srv['commands_per_op']:.2f}", sites, f"{r['cpu_us_per_op']:.0f}",
                f"{r['redis_cpu_pct']:.0f}", f"{r['other_cpu_pct']:.0f}",
                _notes(r, not p["ops_per_row"]),
            ])  # fmt: skip
        title = f"{mode}: " + MODE_TITLES[mode].format(**p)
        print_table(title, MATRIX_COLUMNS, rows, left=("notes",), width=210)
    Console(width=210).print(f"[dim]{LEGEND}[/dim]")
    server_table(
        "Server time per call, one idle client (bench_core phases, median of "
        f"{p['calib_reps']} x {p['calib_n']} calls)",
        res,
        "calibration",
    )
    cpu_parts_table(
        "Client CPU of the pieces of one ledger call, no I/O (bench_core cpu_parts); "
        "tenacity is entered only after a failed first try: for reference",
        res,
    )
    w = mem["what_if_fresh_small_fields"]
    print_table(
        "Memory of one session (MEMORY USAGE SAMPLES 0 of the session hash + its spill keys)",
        ["state", "op retention", "turns", "ledger calls", "run s", "bytes", "fields",
         "encoding", "fields by class", "partition keys B"],
        [[name, f"{v['op_retention_s']} s", str(v["turns"]), f"{v['ledger_calls']:,}",
          f"{v['elapsed_s']:.1f}", f"{v['bytes']:,}", str(v["fields"]), v["encoding"],
          ", ".join(f"{k} {c}" for k, c in v["fields_by_class"].items()),
          f"{v['partition_keys_bytes']:,}"] for name, v in mem["rows"].items()]
        + [["what-if: fresh hash minus fields > 64 B (a copy)", "", "", "", "",
            f"{w['bytes']:,}", str(w["fields"]), w["encoding"],
            "dropped: " + ", ".join(w["dropped_fields"]), ""]],
        left=("encoding", "fields by class"),
        width=210,
    )  # fmt: skip
    Console(width=210).print(
        f"[dim]A turn: begin_turn, 12-18 admits of one ~400-token chunk, admit_tool_result "
        f"(300-1200 tokens), record_span, end_turn, and release of the chunks and tool result "
        f"of the turn {TURN_KEEP} back. 'pause': idle {mem.get('pause_s', 0):.1f} s (> the op "
        f"retention), then {mem.get('after_pause_turns')} more turns (each call drops at most "
        "one expired journal chunk).[/dim]"
    )
    colour = {"PASS": "green", "MISS": "red"}
    print_table(
        "Targets",
        ["target", "measured", "target", "measured / target", "verdict", "how"],
        [[g["target"], _f(g["measured"], ",.2f"), f"{g['kind']} {g['limit']:g}", _f(g["ratio"]),
          f"[{colour.get(g['verdict'], 'yellow')}]{g['verdict']}[/]", g["how"]]
         for g in res["targets"]],
        left=("how",),
        width=210,
    )  # fmt: skip


def run(plan: Plan, progress: Callable[[str], None]) -> dict[str, Any]:
    from ledger.testing import standalone

    t0 = time.perf_counter()
    with standalone() as server:
        assert server.proc is not None
        led = Ledger.from_url(server.url, prefix=f"bf{uuid.uuid4().hex[:8]}", **CLIENT_TIMEOUTS)
        env = environment(led.client)  # type: ignore[arg-type]
        with led, steal_during(env):
            progress(f"redis-server {env['redis_version']} on port {server.port}; calibrating")
            cal, cpu_parts = calibrate(led, plan.calib_n, plan.calib_reps)
            rows = run_matrix(plan, server.url, server.proc.pid, led, progress)
            mem = memory(server.url, plan, progress)
    res: dict[str, Any] = {
        "git": git_commit(),
        "env": env,
        "params": asdict(plan)
        | {"lock_poll_s": alt.LOCK_SLEEP, "watch_max_retries": alt.WATCH_MAX_RETRIES},
        "static_redis_call": static_redis_calls(),
        "rows": rows,
        "calibration": cal,
        "client_cpu_parts": cpu_parts,
        "memory": mem,
    }
    walls = [r["seconds"] for r in rows] or [1.0]
    res["other_cpu"] = {
        "mean_pct": sum(r["other_cpu_pct"] * r["seconds"] for r in rows) / sum(walls),
        "max_pct": max((r["other_cpu_pct"] for r in rows), default=0.0),
    }
    res["targets"] = targets(res, plan)
    res["elapsed_s"] = time.perf_counter() - t0
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_full", description=(__doc__ or "").split("\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes for CI")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    ap.add_argument("--duration", type=float, help="seconds per row (default 1.25)")
    ap.add_argument("--procs", help="worker processes per row, e.g. 1,8,32")
    a = ap.parse_args(argv)
    res = run(make_plan(a), lambda msg: print(msg, file=sys.stderr, flush=True))
    emit(res, a.json, print_report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
