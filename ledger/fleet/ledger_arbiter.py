"""The ledger arbiter: the same turns, decided by the ledger's scripts."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ledger.client import Ledger, Session
from ledger.core import new_op_id
from ledger.errors import AdmissionRefused, FanoutRefused, StaleEpoch, WorkingMemoryStarvation
from ledger.fleet.workload import BUDGET, SessionPlan, TurnPlan
from ledger.models import Consumer, Item, SessionBudget

T = TypeVar("T")
BUDGET_SYSTEM_PROMPT = BUDGET.system_prompt


@dataclass
class LedgerSessionRun:
    plan: SessionPlan
    counts: dict[str, int] = field(default_factory=dict)
    classes: dict[str, int] = field(default_factory=dict)
    retrieval_by_turn: dict[int, float] = field(default_factory=dict)  # share admitted
    residual_by_turn: dict[int, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    min_free: int = 1 << 60
    wm_held: int = 0  # working memory at the end of the last turn
    chunks: list[tuple[str, int]] = field(default_factory=list)  # admitted, oldest first

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


def _timed(run: LedgerSessionRun, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    t0 = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        run.latencies.append(time.perf_counter() - t0)


def _await_compaction(run: LedgerSessionRun, s: Session, timeout: float = 0.25) -> bool:
    """What an agent does on compaction_pending: its next model call waits for the
    compaction (run by the background worker, off the request path)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.005)
        if not s.snapshot().compaction_pending:
            run.count("waited_for_compaction")
            return True
    return False


def run_session(
    ledger: Ledger, budget: SessionBudget, plan: SessionPlan, retry_every: int = 10
) -> LedgerSessionRun:
    """Play a session's turns through the ledger. Every `retry_every`-th admission is
    sent twice with the same op id (a retry after a lost reply) and must match."""
    run = LedgerSessionRun(plan)
    session = ledger.open_session(plan.session_id, budget)
    calls = 0
    for p in plan.turns:
        for _attempt in range(3):
            try:
                calls = _turn(run, session, p, calls, retry_every)
                break
            except StaleEpoch:  # a hard reset by the worker: adopt the new epoch, go on
                run.count("stale_epoch_refreshes")
                session.refresh()
    return run


def _turn(run: LedgerSessionRun, s: Session, p: TurnPlan, calls: int, retry_every: int) -> int:
    try:
        need = max(p.working_set, run.wm_held + p.message)  # the turn's state, in full
        t = _timed(run, s.begin_turn, need)
        if t.regime != "ok":
            run.count(f"starvation_detected_{t.regime}")
            run.count("reclaimed_items", len(t.reclaimed))
        run.residual_by_turn[p.turn] = t.residual
        turn = t.turn
    except WorkingMemoryStarvation as exc:
        run.count("starvation_refused")
        run.residual_by_turn[p.turn] = exc.residual
        turn = s.snapshot().turn
    try:
        _timed(run, s.admit, Consumer.WORKING_MEMORY, [Item(f"t{p.turn}", p.message, 500)])
    except AdmissionRefused as exc:
        run.count(f"wm_refused_{exc.reason}")
    for kind, inp, out in p.spans:
        try:
            _timed(run, s.record_span, turn, kind, inp, out)
        except FanoutRefused:
            run.count("fanout_guard_stops")
            break
    chunks = [Item(f"c{p.turn}-{k}", tok) for k, tok in enumerate(p.chunks)]
    asked, taken = sum(p.chunks), 0
    for attempt in range(2):
        op = new_op_id()
        try:
            batch = list(chunks)
            got = _timed(run, s.admit, Consumer.RETRIEVAL, batch, partial=True, op_id=op)
            calls += 1
            if calls % retry_every == 0:  # the reply was "lost": same op id, same outcome
                if s.admit(Consumer.RETRIEVAL, batch, partial=True, op_id=op) != got:
                    raise AssertionError("a retry must get the first outcome back")
                run.count("retries_replayed")
            taken += got.charged
            run.chunks += [(c.id, c.tokens) for c in chunks if c.id not in got.skipped]
            chunks = [c for c in chunks if c.id in got.skipped]
        except AdmissionRefused as exc:
            run.count(f"retrieval_refused_{exc.reason}")
            if exc.reason == "compaction_pending" and attempt == 0 and _await_compaction(run, s):
                continue  # the compaction landed: judge the set again
        if not chunks or attempt == 1 or not run.chunks:
            break
        # Stale chunks are recoverable by re-query: the agent gives back the oldest to
        # make room for the fresh set (what the naive allocator does implicitly).
        want, stale = sum(c.tokens for c in chunks), []
        while run.chunks and want > 0 and run.chunks[0][0].split("-")[0] != f"c{p.turn}":
            cid, tok = run.chunks.pop(0)
            stale.append(cid)
            want -= tok
        if not stale:
            break
        _timed(run, s.release, Consumer.RETRIEVAL, stale)
        run.count("stale_chunks_released", len(stale))
    run.retrieval_by_turn[p.turn] = taken / asked if asked else 1.0
    for k, tokens in enumerate(p.tools):
        call_id = f"tool{p.turn}-{k}"
        try:
            res = _timed(run, s.admit_tool_result, call_id, tokens, b"{...}")
            run.count(f"tool_{res.outcome}")
            whole = res.charged == tokens or (res.spilled and res.preview_tokens < tokens)
            if res.outcome != "duplicate" and not whole:
                run.count("tool_truncated")
            run.count("memory_evicted", len(res.evicted))
        except AdmissionRefused as exc:
            run.count(f"tool_refused_{exc.reason}")
    snap = _timed(run, s.snapshot)
    run.min_free = min(run.min_free, snap.free)
    run.wm_held = snap.used[Consumer.WORKING_MEMORY]
    if snap.system_prompt != BUDGET_SYSTEM_PROMPT:
        run.count("system_prompt_damage")
    report = _timed(run, s.end_turn, turn, max(1, min(snap.window, snap.occupancy)))
    run.classes[report.classification] = run.classes.get(report.classification, 0) + 1
    return calls
