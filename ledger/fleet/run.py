"""Run the demo: each scenario under its naive arbiter and under the ledger.

The ledger side of every scenario runs on the configured backend with the ledger's
background worker compacting and resetting. Scenario 001 (a fleet of sessions): on a
Redis URL its agents are OS processes and the worker a thread of this process, on the
wall clock; on embedded (the default run) its sessions run one after another on a
stepped clock (``ledger.fleet.agent.SteppedClock``): the worker does its jobs in the
agents' waits, so a seed gives the same figures on any machine, however loaded.
Scenario 002's sessions compact too: on embedded they run on a stepped clock of their
own, on a Redis URL beside a worker thread on the wall clock, as 000 and 004 do.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ledger import schema
from ledger.backends import parse_url
from ledger.client import Ledger
from ledger.fleet import decay, fanout, lengths, starvation, truncation, variants
from ledger.fleet.agent import REAL, Clock, SimAgent, SteppedClock
from ledger.settings import LedgerSettings, require_url
from ledger.workers.compactors import CompactionPlan, CompactionRequest
from ledger.workers.runner import Worker, WorkerSettings

CHECKPOINTS = (10, 60, 120)
WINDOW_TURNS = 5  # checkpoints are read over turn +- this
DEFAULT_SESSIONS = 48
LARGE_SESSIONS = 330
TAIL_SESSIONS = 30  # drawn beyond turn 120, so the turn-120 figures rest on 30 or more
TAIL_FROM = 120
STAGGER_S = 0.5  # sessions start up to this many seconds apart (on the wall clock)
DAY_MS = 86_400_000

T = TypeVar("T")
# progress(stage, steps done): every stage of stages(config), each reported as it goes
Progress = Callable[[str, int], None] | None


@dataclass(frozen=True)
class FleetConfig:
    sessions: int = DEFAULT_SESSIONS  # scenario 001's fleet (the other scenarios are fixed)
    # and this many more from the length distribution's tail beyond turn 120: they enter
    # the per-turn figures (admission at a turn, compaction intervals), not the shares
    tail: int = TAIL_SESSIONS
    workers: int = 4
    max_turns: int = 130
    seed: int = 7
    # the scenarios to run (numbers, docs/demo.md); None: all
    only: frozenset[str] | None = None
    # a rule (ledger/fleet/variants.py) the ledger column runs without; None: every rule
    # on, and each scenario's rule-off column beside it
    without: str | None = None
    # script name -> full Lua text loaded in place of the packaged script, by every ledger
    # the demo makes (its agents and its workers): a rule taken out where it lives (the
    # rule tests, tests/test_demo_rules.py); the rule-off column is then not run
    scripts: Mapping[str, str] = field(default_factory=dict)
    # scenario 001's ledger agents human-paced (a simulated user's think time between
    # turns, docs/demo.md) instead of autonomous (each turn begins as the last one ends)
    paced: bool = False

    @property
    def off_column(self) -> bool:
        """Whether each scenario's rule-off column runs beside the ledger's."""
        return self.without is None and not self.scripts

    def runs(self, scenario: str) -> bool:
        return self.only is None or scenario in self.only

    def rule(self, scenario: str) -> bool:
        """Whether the ledger column has this scenario's rule."""
        return self.without != variants.RULES[scenario]


SCENARIOS = ("001", "000", "002", "004")
STAGES = {
    "001": "001 compaction-decay sessions",
    "000": "000 starvation",
    "002": "002 truncation loop",
    "004": "004 fan-out",
}


def stages(config: FleetConfig) -> dict[str, int]:
    """The demo's stages and their steps, in the order they run (for a progress display)."""
    out = {
        STAGES[k]: (
            (config.sessions + config.tail) * (2 if config.off_column else 1) if k == "001" else 1
        )
        for k in SCENARIOS
        if config.runs(k)
    }
    return out | {"audits": 1}


@dataclass
class DemoReport:
    config: FleetConfig
    backend: str
    decay_naive: list[decay.SessionRun]
    decay_ledger: list[decay.SessionRun]
    decay_off: list[decay.SessionRun] | None  # the ledger without compaction credit
    starvation: starvation.Result | None
    truncation: truncation.Result | None
    fanout: fanout.Result | None
    ledger_calls: int
    over_allocations: int
    audits_clean: int
    audits_total: int
    worker_jobs: dict[str, float]
    elapsed: float
    notes: dict[str, Any] = field(default_factory=dict)


# --- the background worker ------------------------------------------------------------


@contextmanager
def background_worker(
    settings: LedgerSettings,
    compactor: str,
    credit: bool = True,
    scripts: Mapping[str, str] | None = None,
) -> Iterator[Worker]:
    """The ledger's worker in a thread; `credit=False`: its scripts without compaction
    credit (ledger/fleet/variants.py); `scripts`: these texts in place of the packaged."""
    with demo_worker(settings, compactor, credit, scripts) as worker:
        stop = threading.Event()
        thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
        thread.start()
        try:
            yield worker
        finally:
            stop.set()
            thread.join(10)


@contextmanager
def demo_worker(
    settings: LedgerSettings,
    compactor: str | Callable[[CompactionRequest], CompactionPlan],
    credit: bool = True,
    scripts: Mapping[str, str] | None = None,
    claim_idle_ms: int = 2_000,
) -> Iterator[Worker]:
    """The ledger's worker as the demo configures it, not running: a thread runs it
    (:func:`background_worker`) or a stepped clock steps it (``SteppedClock``, with
    claims of idle jobs out of reach: they are timed on the wall clock)."""
    led = variants.load(Ledger.from_settings(settings), scripts or {})
    if not credit:
        variants.without_credit(led)
    worker = Worker(
        led,
        WorkerSettings(
            poll_interval=0.005,
            sweep_interval=0.5,
            claim_idle_ms=claim_idle_ms,
            consumer=f"demo-{uuid.uuid4().hex[:6]}",
            compactor=compactor if isinstance(compactor, str) else None,
        ),
        compactor=None if isinstance(compactor, str) else compactor,
    )
    worker.ensure_groups()
    try:
        yield worker
    finally:
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


@dataclass(frozen=True, kw_only=True)
class DecayJob:
    settings: LedgerSettings
    session_id: str
    index: int
    seed: int
    turns: int
    credit: bool = True
    tail: bool = False
    start_s: float = 0.0  # when the session starts, after its job is taken (staggered)
    scripts: Mapping[str, str] = field(default_factory=dict)  # FleetConfig.scripts
    paced: bool = False  # FleetConfig.paced


def _decay_one(job: DecayJob, clock: Clock = REAL) -> tuple[decay.SessionRun, int]:
    if clock is REAL:
        time.sleep(job.start_s)
    with variants.load(Ledger.from_settings(job.settings), job.scripts) as led:
        if not job.credit:
            variants.without_credit(led)
        agent = SimAgent(led, job.session_id, decay.BUDGET, clock=clock)
        run = decay.run_ledger(agent, decay.plan(job.seed, job.index, job.turns), job.paced)
        run.tail = job.tail
        return run, agent.calls


def decay_fleet_plan(config: FleetConfig) -> list[tuple[str, int, int, bool]]:
    """Scenario 001's sessions: (id, plan index, turns, from the tail), the fleet first."""
    fleet = lengths.session_lengths(config.seed, config.sessions, config.max_turns)
    out = [(f"decay-{config.seed}-{i}", i, n, False) for i, n in enumerate(fleet)]
    if config.max_turns >= TAIL_FROM:
        tail = lengths.tail_lengths(config.seed, config.tail, TAIL_FROM, config.max_turns)
        out += [
            (f"decay-{config.seed}-t{k}", config.sessions + k, n, True) for k, n in enumerate(tail)
        ]
    return out


def stepped(settings: LedgerSettings) -> bool:
    """Whether scenarios 001 and 002 run on a stepped clock: on embedded (one process,
    the default run and the CI gate), so that a seed gives the same figures on any
    machine. On a Redis URL their agents run beside a worker thread (001's are OS
    processes), on the wall clock."""
    return parse_url(require_url(settings)).kind == "embedded"


def _pool_map(
    fn: Callable[[Any], T], jobs: Sequence[Any], workers: int, progress: Progress
) -> list[T]:
    """fn over jobs in spawned processes (the agents on a Redis server)."""
    out: list[T] = []
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for r in pool.imap(fn, jobs):
            out.append(r)
            if progress:
                progress("001 compaction-decay sessions", 1)
    return out


def _decay_fleet(
    settings: LedgerSettings,
    config: FleetConfig,
    tag: str,
    credit: bool,
    progress: Progress,
) -> tuple[list[decay.SessionRun], int, list[str], dict[str, float]]:
    """Scenario 001's fleet on the ledger (with or without compaction credit), its own
    worker alongside: (runs by index, ledger calls, session ids, worker job totals)."""
    jobs = sorted(
        (
            DecayJob(
                settings=settings,
                session_id=f"{sid}@{tag}",
                index=i,
                seed=config.seed,
                turns=n,
                credit=credit,
                tail=tail,
                start_s=STAGGER_S * decay.unit("start", config.seed, i),
                scripts=dict(config.scripts),
                paced=config.paced,
            )
            for sid, i, n, tail in decay_fleet_plan(config)
        ),
        key=lambda j: -j.turns,
    )
    if stepped(settings):
        # One session after another on a clock their waits step: the same figures on any
        # machine, however loaded (the worker's jobs land in the agents' waits).
        clock = SteppedClock()
        timed = clock.timed(decay.summarize, decay.summarize_seconds)
        with demo_worker(settings, timed, credit, config.scripts, DAY_MS) as clock.worker:
            results = []
            for job in jobs:
                results.append(_decay_one(job, clock))
                if progress:
                    progress("001 compaction-decay sessions", 1)
            totals = _metric_totals(clock.worker)
    else:
        with background_worker(
            settings, "ledger.fleet.decay:compactor", credit, config.scripts
        ) as worker:
            results = _pool_map(_decay_one, jobs, config.workers, progress)
            totals = _metric_totals(worker)
    by_id = {r.session_id: (r, c) for r, c in results}
    runs = [by_id[j.session_id][0] for j in sorted(jobs, key=lambda j: j.index)]
    return runs, sum(c for _, c in results), [j.session_id for j in jobs], totals


@contextmanager
def _scenario_ledger(
    settings: LedgerSettings, config: FleetConfig, step: bool, worker_jobs: dict[str, float]
) -> Iterator[tuple[Ledger, Clock]]:
    """A ledger for scenarios 000, 002 and 004 and the clock their agents wait in, the
    worker (the simulated compactor) beside them: a thread on the wall clock, or (`step`)
    stepped by their waits. Its job totals are added to `worker_jobs` at the end."""
    compactor = "ledger.fleet.agent:untagged"
    if step:
        clock = SteppedClock()
        with demo_worker(settings, compactor, True, config.scripts, DAY_MS) as clock.worker:
            with variants.load(Ledger.from_settings(settings), config.scripts) as led:
                yield led, clock
            totals = _metric_totals(clock.worker)
    else:
        with background_worker(settings, compactor, scripts=config.scripts) as worker:
            with variants.load(Ledger.from_settings(settings), config.scripts) as led:
                yield led, REAL
            totals = _metric_totals(worker)
    for k, v in totals.items():
        worker_jobs[k] = worker_jobs.get(k, 0) + v


def run(settings: LedgerSettings, config: FleetConfig, progress: Progress = None) -> DemoReport:
    if config.without is not None and config.without not in variants.RULES.values():
        raise ValueError(
            f"no rule named {config.without!r}: one of {', '.join(variants.RULES.values())}"
        )
    tag = uuid.uuid4().hex[:6]
    t0 = time.perf_counter()
    naive_runs: list[decay.SessionRun] = []
    ledger_runs: list[decay.SessionRun] = []
    off_runs: list[decay.SessionRun] | None = None
    worker_jobs: dict[str, float] = {}
    calls = 0
    session_ids: list[str] = []
    if config.runs("001"):
        naive_runs = []
        for sid, i, n, tail in decay_fleet_plan(config):
            naive_runs.append(decay.run_naive(sid, decay.plan(config.seed, i, n)))
            naive_runs[-1].tail = tail
        fleets = [(tag, config.rule("001"))]
        if config.off_column:
            fleets.append((f"{tag}-off", False))
        for fleet_tag, credit in fleets:
            # every column runs the same sessions, the tail too: each column's turn-120
            # figures rest on the same 30 or more sessions
            runs, n_calls, ids, totals = _decay_fleet(settings, config, fleet_tag, credit, progress)
            if fleet_tag == tag:
                ledger_runs = runs
            else:
                off_runs = runs
            calls += n_calls
            session_ids += ids
            for k, v in totals.items():
                worker_jobs[k] = worker_jobs.get(k, 0) + v

    starv = trunc = fan = None
    off = config.off_column
    # 000, 002 and 004 one after another, beside a worker thread on the wall clock; on
    # embedded, 002 on a stepped clock of its own (as 001): its worker makes a pass in its
    # agents' waits, so the compactions its turns request land alike however loaded the
    # machine is. A stepped worker beside a thread would lose its jobs to the thread, so
    # the thread stops for it and another starts after it.
    batches: list[tuple[bool, list[str]]] = []
    for k in ("000", "002", "004"):
        if not config.runs(k):
            continue
        step = k == "002" and stepped(settings)
        if batches and not step and not batches[-1][0]:
            batches[-1][1].append(k)
        else:
            batches.append((step, [k]))
    for step, names in batches:
        with _scenario_ledger(settings, config, step, worker_jobs) as (led, clock):
            for k in names:
                if k == "000":
                    starv = starvation.run(led, config.seed, tag, config.rule("000"), off)
                elif k == "002":
                    trunc = truncation.run(led, config.seed, tag, config.rule("002"), off, clock)
                else:
                    fan = fanout.run(led, config.seed, tag, config.rule("004"), off)
                if progress:
                    progress(STAGES[k], 1)
    for part in (starv, trunc, fan):
        if part is not None:
            calls += part.calls
            session_ids += part.session_ids

    over, clean, failed = 0, 0, 0
    with Ledger.from_settings(settings) as led:
        for sid in session_ids:
            report = led.audit(sid)
            clean += report.clean
            snap = led.session(sid).snapshot()
            over += snap.free < 0 or any("over-allocated" in p for p in report.problems)
            if sid.startswith("decay-") and sid.endswith(f"@{tag}"):
                failed += snap.raw.get(schema.COUNTER.of("failed_compactions"), 0)
            led.session(sid).delete()
    if progress:
        progress("audits", 1)
    return DemoReport(
        config=config,
        backend=require_url(settings).split("://")[0],
        decay_naive=naive_runs,
        decay_ledger=ledger_runs,
        decay_off=off_runs,
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
