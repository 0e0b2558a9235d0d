"""Run the demo: each scenario under its naive arbiter and under the ledger.

The ledger side of every scenario runs on the configured backend with the
background worker (a thread of this process) compacting and resetting alongside;
on embedded the agents are threads, on a Redis URL they are OS processes.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ledger.backends import parse_url
from ledger.client import Ledger
from ledger.fleet import decay, fanout, starvation, truncation
from ledger.fleet.agent import SimAgent
from ledger.settings import LedgerSettings, require_url
from ledger.workers.runner import Worker, WorkerSettings

CHECKPOINTS = (10, 60, 120)
WINDOW_TURNS = 5  # checkpoints are read over turn +- this
DEFAULT_SESSIONS = 48
LARGE_SESSIONS = 330

T = TypeVar("T")
# progress(stage, steps done): every stage of stages(config), each reported as it goes
Progress = Callable[[str, int], None] | None


@dataclass(frozen=True)
class FleetConfig:
    sessions: int = DEFAULT_SESSIONS  # scenario 001's fleet (the other scenarios are fixed)
    workers: int = 4
    max_turns: int = 130
    seed: int = 7


def stages(config: FleetConfig) -> dict[str, int]:
    """The demo's stages and their steps, in the order they run (for a progress display)."""
    return {
        "001 compaction-decay sessions": config.sessions,
        "000 starvation": 1,
        "002 truncation loop": 1,
        "004 fan-out": 1,
        "audits": 1,
    }


@dataclass
class DemoReport:
    config: FleetConfig
    backend: str
    decay_naive: list[decay.SessionRun]
    decay_ledger: list[decay.SessionRun]
    starvation: starvation.Result
    truncation: truncation.Result
    fanout: fanout.Result
    ledger_calls: int
    over_allocations: int
    audits_clean: int
    audits_total: int
    worker_jobs: dict[str, float]
    elapsed: float
    notes: dict[str, Any] = field(default_factory=dict)


# --- the background worker ------------------------------------------------------------


@contextmanager
def background_worker(settings: LedgerSettings, compactor: str) -> Iterator[Worker]:
    led = Ledger.from_settings(settings)
    worker = Worker(
        led,
        WorkerSettings(
            poll_interval=0.005,
            sweep_interval=0.5,
            claim_idle_ms=2_000,
            consumer=f"demo-{uuid.uuid4().hex[:6]}",
            compactor=compactor,
        ),
    )
    worker.ensure_groups()
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        stop.set()
        thread.join(10)
        led.close()


def _metric_totals(worker: Worker) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in worker.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.value:
                key = sample.name.removeprefix("ledger_").removesuffix("_total")
                label = ",".join(str(v) for v in sample.labels.values())
                out[f"{key}({label})" if label else key] = sample.value
    return out


# --- scenario 001 on the ledger -----------------------------------------------------------


@dataclass(frozen=True)
class DecayJob:
    settings: LedgerSettings
    session_id: str
    index: int
    seed: int
    turns: int


def _decay_one(job: DecayJob) -> tuple[decay.SessionRun, int]:
    with Ledger.from_settings(job.settings) as led:
        agent = SimAgent(led, job.session_id, decay.BUDGET)
        run = decay.run_ledger(agent, decay.plan(job.seed, job.index, job.turns))
        return run, agent.calls


def _pool_map(
    settings: LedgerSettings,
    fn: Callable[[Any], T],
    jobs: Sequence[Any],
    workers: int,
    progress: Progress,
) -> list[T]:
    """fn over jobs: threads on embedded, spawned processes on a Redis server."""
    out: list[T] = []
    if parse_url(require_url(settings)).kind == "embedded":
        with ThreadPoolExecutor(workers) as pool:
            for r in pool.map(fn, jobs):
                out.append(r)
                if progress:
                    progress("001 compaction-decay sessions", 1)
    else:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            for r in pool.imap(fn, jobs):
                out.append(r)
                if progress:
                    progress("001 compaction-decay sessions", 1)
    return out


def run(settings: LedgerSettings, config: FleetConfig, progress: Progress = None) -> DemoReport:
    tag = uuid.uuid4().hex[:6]
    t0 = time.perf_counter()
    lengths = decay.session_lengths(config.seed, config.sessions, config.max_turns)
    ids = [f"decay-{config.seed}-{i}" for i in range(config.sessions)]
    naive_runs = [
        decay.run_naive(sid, decay.plan(config.seed, i, n))
        for i, (sid, n) in enumerate(zip(ids, lengths, strict=True))
    ]
    jobs = sorted(
        (
            DecayJob(settings, f"{sid}@{tag}", i, config.seed, n)
            for i, (sid, n) in enumerate(zip(ids, lengths, strict=True))
        ),
        key=lambda j: -j.turns,
    )
    calls = 0
    with background_worker(settings, "ledger.fleet.decay:compactor") as worker:
        results = _pool_map(settings, _decay_one, jobs, config.workers, progress)
        worker_jobs = _metric_totals(worker)
    by_id = {r.session_id: (r, c) for r, c in results}
    ledger_runs = [by_id[j.session_id][0] for j in sorted(jobs, key=lambda j: j.index)]
    calls += sum(c for _, c in results)
    session_ids = [j.session_id for j in jobs]

    with background_worker(settings, "ledger.workers.compactors:simulated") as worker:
        with Ledger.from_settings(settings) as led:
            starv = starvation.run(led, config.seed, tag)
            if progress:
                progress("000 starvation", 1)
            trunc = truncation.run(led, config.seed, tag)
            if progress:
                progress("002 truncation loop", 1)
            fan = fanout.run(led, config.seed, tag)
            if progress:
                progress("004 fan-out", 1)
        for k, v in _metric_totals(worker).items():
            worker_jobs[k] = worker_jobs.get(k, 0) + v
    calls += starv.calls + trunc.calls + fan.calls
    session_ids += starv.session_ids + trunc.session_ids + fan.session_ids

    over, clean, failed = 0, 0, 0
    with Ledger.from_settings(settings) as led:
        for sid in session_ids:
            report = led.audit(sid)
            clean += report.clean
            snap = led.session(sid).snapshot()
            over += snap.free < 0 or any("over-allocated" in p for p in report.problems)
            if sid.startswith("decay-"):
                failed += snap.raw.get("x:failed_compactions", 0)
            led.session(sid).delete()
    if progress:
        progress("audits", 1)
    return DemoReport(
        config=config,
        backend=require_url(settings).split("://")[0],
        decay_naive=naive_runs,
        decay_ledger=ledger_runs,
        starvation=starv,
        truncation=trunc,
        fanout=fan,
        ledger_calls=calls,
        over_allocations=over,
        audits_clean=clean,
        audits_total=len(session_ids),
        worker_jobs=worker_jobs,
        elapsed=time.perf_counter() - t0,
        notes={"failed_compactions": failed},
    )
