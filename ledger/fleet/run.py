"""Run the fleet: the same seeded sessions under the naive arbiter and the ledger."""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ledger.backends import parse_url
from ledger.client import Ledger
from ledger.fleet import ledger_arbiter, naive
from ledger.fleet.workload import BUDGET, SessionPlan, session_plan
from ledger.settings import LedgerSettings, require_url
from workers.compactors import simulated
from workers.runner import Worker, WorkerSettings

CHECKPOINTS = (10, 60, 120)


@dataclass(frozen=True)
class FleetConfig:
    sessions: int = 24
    workers: int = 4
    max_turns: int = 130
    seed: int = 7


@dataclass
class ArbiterSummary:
    name: str
    retrieval_rate: dict[int, tuple[float, int]]  # turn -> (mean share admitted, sessions)
    retrieval_curve: list[float]
    residual_curve: list[float]
    counts: dict[str, int]
    classes: dict[str, int] = field(default_factory=dict)
    turns: int = 0


@dataclass
class FleetReport:
    config: FleetConfig
    backend: str
    naive: ArbiterSummary
    ledger: ArbiterSummary
    elapsed: float
    ledger_calls: int
    ops_per_second: float
    p50_ms: float
    p99_ms: float
    over_allocations: int
    audits_clean: int
    audits_total: int
    worker_jobs: dict[str, float]


def _curves(
    by_turn: Iterable[tuple[dict[int, float], dict[int, int]]], max_turn: int
) -> tuple[dict[int, tuple[float, int]], list[float], list[float]]:
    admitted = [0.0] * (max_turn + 1)
    alive = [0] * (max_turn + 1)
    residual = [0.0] * (max_turn + 1)
    seen = [0] * (max_turn + 1)
    for retr, res in by_turn:
        for t, ok in retr.items():
            alive[t] += 1
            admitted[t] += ok
        for t, r in res.items():
            residual[t] += r
            seen[t] += 1
    rate = [admitted[t] / alive[t] if alive[t] else float("nan") for t in range(max_turn + 1)]
    resid = [residual[t] / seen[t] if seen[t] else float("nan") for t in range(max_turn + 1)]
    points = {c: (rate[c], alive[c]) for c in CHECKPOINTS if c <= max_turn}
    return points, rate, resid


def _sum(dicts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _ledger_chunk(
    settings: LedgerSettings, plans: list[SessionPlan]
) -> list[ledger_arbiter.LedgerSessionRun]:
    with Ledger.from_settings(settings) as led:
        return [ledger_arbiter.run_session(led, BUDGET, p) for p in plans]


def run(
    settings: LedgerSettings, config: FleetConfig, progress: Callable[[int], None] | None = None
) -> FleetReport:
    plans = [session_plan(config.seed, i, config.max_turns) for i in range(config.sessions)]
    plans = [
        SessionPlan(f"{p.session_id}-{time.time_ns() % 10**9}", p.turns, p.fragmenting)
        for p in plans
    ]
    max_turn = max(len(p.turns) for p in plans)
    embedded = parse_url(require_url(settings)).kind == "embedded"

    naive_runs = [naive.run_session(BUDGET, p, simulated) for p in plans]

    stop = threading.Event()
    worker_ledger = Ledger.from_settings(settings)
    worker = Worker(
        worker_ledger,
        WorkerSettings(
            poll_interval=0.01,
            sweep_interval=0.5,
            claim_idle_ms=2_000,
            consumer="demo-worker",
            compactor="workers.compactors:simulated",
        ),
    )
    worker.ensure_groups()
    background = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    background.start()
    t0 = time.perf_counter()
    runs: list[ledger_arbiter.LedgerSessionRun] = []
    chunks = [plans[i :: config.workers] for i in range(config.workers)]
    try:
        if embedded:
            with ThreadPoolExecutor(config.workers) as pool:
                futures = [pool.submit(_each, settings, chunk, progress) for chunk in chunks]
                for f in futures:
                    runs.extend(f.result())
        else:
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(config.workers) as pool:
                for part in pool.imap_unordered(_one, [(settings, p) for p in plans]):
                    runs.append(part)
                    if progress:
                        progress(1)
    finally:
        elapsed = time.perf_counter() - t0
        time.sleep(0.2)
        stop.set()
        background.join(10)
    latencies = [x for r in runs for x in r.latencies]
    audits = [worker_ledger.audit(p.session_id) for p in plans]
    snaps = {p.session_id: worker_ledger.session(p.session_id).snapshot() for p in plans}
    for p in plans:
        worker_ledger.session(p.session_id).close(op_id=f"close-{p.session_id}")
    worker_ledger.close()

    n_points, n_curve, n_resid = _curves(
        ((r.retrieval_by_turn, r.residual_by_turn) for r in naive_runs), max_turn
    )
    l_points, l_curve, l_resid = _curves(
        ((r.retrieval_by_turn, r.residual_by_turn) for r in runs), max_turn
    )
    lcounts = _sum(r.counts for r in runs)
    for name in ("x:failed_compactions", "x:resets", "x:spilled", "x:starvation", "x:refused"):
        lcounts[name[2:]] = sum(s.raw.get(name, 0) for s in snaps.values())
    lcounts["compactions"] = sum(s.raw.get("kn", 0) for s in snaps.values())
    turns = sum(len(p.turns) for p in plans)
    return FleetReport(
        config=config,
        backend=require_url(settings).split("://")[0],
        naive=ArbiterSummary(
            "naive", n_points, n_curve, n_resid, _sum(r.counts for r in naive_runs), {}, turns
        ),
        ledger=ArbiterSummary(
            "ledger", l_points, l_curve, l_resid, lcounts, _sum(r.classes for r in runs), turns
        ),
        elapsed=elapsed,
        ledger_calls=len(latencies),
        ops_per_second=len(latencies) / elapsed if elapsed else 0.0,
        p50_ms=1000 * statistics.median(latencies) if latencies else 0.0,
        p99_ms=1000 * statistics.quantiles(latencies, n=100)[98] if len(latencies) > 1 else 0.0,
        over_allocations=sum(1 for r in runs if r.min_free < 0)
        + sum(1 for a in audits if any("over-allocated" in x for x in a.problems)),
        audits_clean=sum(1 for a in audits if a.clean),
        audits_total=len(audits),
        worker_jobs={k: v for k, v in _metric_totals(worker).items()},
    )


def _each(
    settings: LedgerSettings, plans: list[SessionPlan], progress: Callable[[int], None] | None
) -> list[ledger_arbiter.LedgerSessionRun]:
    out = []
    with Ledger.from_settings(settings) as led:
        for p in plans:
            out.append(ledger_arbiter.run_session(led, BUDGET, p))
            if progress:
                progress(1)
    return out


def _one(arg: tuple[LedgerSettings, SessionPlan]) -> ledger_arbiter.LedgerSessionRun:
    settings, plan = arg
    with Ledger.from_settings(settings) as led:
        return ledger_arbiter.run_session(led, BUDGET, plan)


def _metric_totals(worker: Worker) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in worker.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                key = sample.name.removeprefix("ledger_").removesuffix("_total")
                label = ",".join(str(v) for v in sample.labels.values())
                out[f"{key}({label})" if label else key] = sample.value
    return out


def as_json(report: FleetReport) -> dict[str, Any]:
    def arb(a: ArbiterSummary) -> dict[str, Any]:
        return {
            "retrieval_admission": {
                str(k): {"rate": v[0], "sessions": v[1]} for k, v in a.retrieval_rate.items()
            },
            "counts": a.counts,
            "classes": a.classes,
            "turns": a.turns,
        }

    return {
        "config": report.config.__dict__,
        "backend": report.backend,
        "naive": arb(report.naive),
        "ledger": arb(report.ledger),
        "elapsed_s": report.elapsed,
        "ledger_calls": report.ledger_calls,
        "ops_per_second": report.ops_per_second,
        "p50_ms": report.p50_ms,
        "p99_ms": report.p99_ms,
        "over_allocations": report.over_allocations,
        "audits_clean": report.audits_clean,
        "audits_total": report.audits_total,
        "worker": report.worker_jobs,
    }
