"""Scenario 001, compaction decay: retrieval starved under a green latency SLO.

The regime of this scenario (docs/demo.md): a 128k window, sessions of median 40 and p99 210 turns,
a 900 ms per-turn latency SLO, a high-water mark H = 0.72 of the window. Each turn
adds a user message, a recall lookup, 4-8 retrieved chunks and the model's
generation to the history: 2-5% of the window a turn. A summarizer compacts the
history "on average": raw history shrinks to 21.5-43% of its size, but a summary
summarized again keeps 100-107% of itself (SUMMARY_KEEP) and long answers from stale
memory keep 50-70%, so a session's summaries accumulate (the soft post-condition). The
naive collapse comes from that summary keep alone: without the stale-answer feedback
(answers as long without retrieval) it is the same. A re-summarized summary's keep can
be drawn instead from a lognormal that shrinks it on average and grows some
(SUMMARY_KEEP_LOGNORMAL); the naive baseline then creeps but stays short of the window,
where the naive arbiter's literal check refuses retrieval, so retrieval does not
decline by turn 60 (tests/test_fleet.py); the demo keeps SUMMARY_KEEP.

The naive arbiter has exactly the scenario's conditions: compaction is synchronous,
on the request path, its latency charged to the turn that triggers it; the latency
check is per turn; nothing checks what the summarizer produced; operations are
ranked by estimated latency per token, with compaction's latency amortized over
the turns it is expected to last; feasibility is judged on the current occupancy
(a compaction of the turn applied first: its summary in place of the history it
replaced); a turn without retrieval answers from stale parametric memory, with
generations four times longer.

The ledger runs the same turns: compaction is asynchronous (the background worker,
the same summarizer), judged against H and the minimum gain, escalated to a hard
reset after three failures. By default its agents are autonomous: each turn begins as
the last one ends (no user think time), the clock moves by each turn's own latency,
and the agent waits, bounded by the agent layer's defaults, for a pending compaction
before it begins a turn. A human-paced fleet (``paced``) is the variant: a simulated
user's think time between turns, in which the worker compacts.

Latency model (both): 100 ms + prefill 2.2 ms per 1k prompt tokens + recall 50 ms +
retrieval 180 ms + generation 0.055 ms per token; a synchronous compaction 120 ms +
0.9 ms per 1k tokens summarized; the ledger's agent pays the same for a compaction it
waited for in a turn, and 700 ms to rebuild its context after a hard reset (re-query,
re-summarize the durable transcript, prefill).
"""

from __future__ import annotations

import hashlib
import inspect
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

from ledger import schema
from ledger.agent.core import AgentCore
from ledger.errors import AdmissionRefused, StaleEpoch, WorkingMemoryStarvation
from ledger.fleet.agent import Doc, SimAgent
from ledger.models import Consumer, Item, SessionBudget, Snapshot
from ledger.workers.compactors import CompactionPlan, CompactionRequest

WM, RET, REC = Consumer.WORKING_MEMORY, Consumer.RETRIEVAL, Consumer.RECALL

WINDOW = 128_000
SYSTEM = 3_000
SLO_MS = 900.0
STALE = 4  # generations without retrieval are this many times longer
OUTPUT_MARGIN = 1.25  # the output reserve: the expected generation and a margin

BUDGET = SessionBudget(
    window=WINDOW,
    system_prompt=SYSTEM,
    output_reserve=2_000,
    high_water_mark=0.72,
    eviction_threshold=0.90,
    max_failed_compactions=3,
    compaction_min_gain=0.25,
)
H = BUDGET.high_water_tokens

# Summarizer: share of its size each kind of item keeps once summarized, uniform on
# (lo, hi). A summary summarized again keeps SUMMARY_KEEP unless SUMMARY_KEEP_LOGNORMAL
# is set: (mean, sigma) of a lognormal keep ratio, which shrinks a summary on average
# (mean < 1) and grows some (its right tail). None by default: under the naive arbiter's
# window check, a summary that shrinks on average does not reach the window by turn 60
# (docs/demo.md), so the record's decline is not shown with it.
RAW_KEEP = (0.215, 0.43)
SUMMARY_KEEP = (1.00, 1.07)
SUMMARY_KEEP_LOGNORMAL: tuple[float, float] | None = None
LONG_KEEP = (0.50, 0.70)

# Latency model, ms.
BASE_MS, PREFILL_MS_PER_K, GEN_MS_PER_TOKEN = 100.0, 2.2, 0.055
RECALL_MS, RETRIEVAL_MS = 50.0, 180.0
COMPACT_MS, COMPACT_MS_PER_K = 120.0, 0.9
REBUILD_MS = 700.0
# Time in the demo runs at 1/50 of a real deployment's (TIME_SCALE): the worker's
# summarizer call (a model's 3 s + 20 ms per 1k tokens summarized: 4.8 s for a 90k-token
# history), an autonomous agent's turn (its simulated latency), and the agent's bounds on
# waiting for a pending compaction before it begins a turn. A streak of failed
# compactions outlasts the wait, so the turn is judged against it. On a stepped clock
# (the default run) all of them are simulated time.
TIME_SCALE = 50
SUMMARIZE_S, SUMMARIZE_S_PER_K = 0.06, 0.0004
AMORTIZE_TURNS = 9  # the naive arbiter's estimate of the turns a compaction lasts
# An autonomous agent's bound on waiting for a pending compaction at a begin: the agent
# layer's default (Agent(await_compaction=...), 2 s), at the demo's time scale; the
# bound on waiting for one no worker picked up (compaction_pickup) likewise, where the
# clock has one (the wall clock; on a stepped clock the worker always picks it up).
AWAIT_DEFAULT_S = inspect.signature(AgentCore.__init__).parameters["await_compaction"].default
AUTONOMOUS_WAIT_S = AWAIT_DEFAULT_S / TIME_SCALE
# The human-paced variant (FleetConfig.paced): the simulated user thinks between turns
# (THINK_S, during which the agent waits for the worker's verdict on a pending
# compaction), but answers at once on a share of turns (QUICK: the agent then does not
# wait at the begin either); on the others the agent waits COMPACTION_WAIT_S at a begin.
THINK_S = 5.0
QUICK = 0.1  # share of turns the user answers at once (no think time)
COMPACTION_WAIT_S = 0.15  # the paced agent's bound on waiting for a pending compaction


@dataclass(frozen=True, slots=True)
class TurnPlan:
    turn: int
    message: int
    recall: int
    chunks: tuple[int, ...]
    generation: int  # tokens of the answer when retrieval is in the prompt
    quick: bool = False  # paced only: the user answered at once: no think time, and the
    # agent does not wait for a pending compaction (the turn is judged against it instead)


@dataclass
class TurnRecord:
    """One turn as an observer sees it (the arbiters do not all see these)."""

    turn: int
    retrieval: bool  # retrieval admitted into the final prompt
    compaction: bool = False  # a compaction took effect before this turn's prompt
    post_compaction: int | None = None  # occupancy right after it, tokens
    latency_ms: float = 0.0
    refusal: str | None = None  # why retrieval was not admitted
    bound: str | None = None  # compaction_pending: which bound
    headroom_ms: float | None = None  # latency headroom the arbiter saw at a refusal
    waited: bool = False  # the agent waited for a compaction in this turn
    reset: bool = False  # the turn rebuilt its context after a hard reset
    # the cures' costs: (tokens, items) each hard reset before it discarded (as of the
    # agent's last reading), deployment ms its begins waited for a compaction, retrieval
    # tokens not admitted; naive: the ms its synchronous compaction charged to it
    discarded: list[tuple[int, int]] = field(default_factory=list)
    wait_ms: float = 0.0
    refused_tokens: int = 0
    compaction_ms: float = 0.0

    @property
    def over_slo(self) -> bool:
        return self.latency_ms > SLO_MS


@dataclass
class SessionRun:
    session_id: str
    records: list[TurnRecord] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    tail: bool = False  # drawn from the length distribution's tail (lengths.py)

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def count_of(self, name: str) -> int:
        return self.counts.get(name, 0)


# --- workload ---------------------------------------------------------------------


def plan(seed: int, index: int, turns: int) -> tuple[TurnPlan, ...]:
    rng = random.Random(seed * 1_000_003 + index)
    return tuple(
        TurnPlan(
            turn=t,
            message=rng.randint(300, 700),
            recall=rng.randint(800, 1_600),
            chunks=tuple(rng.randint(300, 420) for _ in range(rng.randint(4, 8))),
            generation=rng.randint(600, 1_100),
            quick=unit("quick", seed, index, t) < QUICK,  # (the sizes' draws unchanged)
        )
        for t in range(1, turns + 1)
    )


# --- the summarizer (both arbiters; the ledger's worker runs it as its compactor) ----


def unit(*parts: object) -> float:
    d = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(d, "big") / 2**32


def keep_ratio(session_id: str, turn: int, iid: str) -> float:
    """The share of its size the item keeps once summarized at `turn`."""
    u = unit(session_id.rsplit("@", 1)[0], turn, iid)
    if iid.startswith("sum-") and SUMMARY_KEEP_LOGNORMAL is not None:
        mean, sigma = SUMMARY_KEEP_LOGNORMAL
        z = NormalDist().inv_cdf(min(max(u, 1e-9), 1 - 1e-9))
        return mean * math.exp(sigma * z - sigma * sigma / 2)
    lo, hi = (
        SUMMARY_KEEP
        if iid.startswith("sum-")
        else LONG_KEEP
        if iid.startswith("long-")
        else RAW_KEEP
    )
    return lo + (hi - lo) * u


def summary_tokens(session_id: str, turn: int, items: Sequence[tuple[str, int]]) -> int:
    """What the soft summarizer makes of (id, tokens) items: deterministic, per item."""
    return int(sum(tokens * keep_ratio(session_id, turn, iid) for iid, tokens in items))


def compactor(request: CompactionRequest) -> CompactionPlan:
    """The worker's compactor for this scenario on the wall clock: :func:`summarize`,
    taking the time a summarizer's model call would at the demo's time scale
    (SUMMARIZE_S...), so a turn that begins at once finds its compaction still pending."""
    time.sleep(summarize_seconds(request))
    return summarize(request)


def summarize_seconds(request: CompactionRequest) -> float:
    """The time the summarizer's model call takes, at the demo's time scale."""
    held = sum(i.tokens for i in request.items if i.turn < request.turn)
    return SUMMARIZE_S + SUMMARIZE_S_PER_K * held / 1000 if held else 0.0


def summarize(request: CompactionRequest) -> CompactionPlan:
    """The scenario's summarizer: every item from before the turn the compaction
    prepares becomes one summary (a working-memory item). On a stepped clock it is the
    worker's compactor, timed by :func:`summarize_seconds` in simulated time
    (``SteppedClock.timed``)."""
    old = [i for i in request.items if i.turn < request.turn]
    if not old:
        return CompactionPlan((), None)
    tokens = summary_tokens(request.session_id, request.turn, [(i.id, i.tokens) for i in old])
    return CompactionPlan(
        tuple((i.consumer, i.id) for i in old),
        Item(f"sum-{request.turn}-{len(old)}", max(1, tokens), 1000),
    )


# --- latency -----------------------------------------------------------------------


def prefill_ms(tokens: int) -> float:
    return PREFILL_MS_PER_K * tokens / 1000


def compaction_ms(tokens: int) -> float:
    return COMPACT_MS + COMPACT_MS_PER_K * tokens / 1000


# --- the naive arbiter ----------------------------------------------------------------


@dataclass
class _Held:
    id: str
    tokens: int
    turn: int


def run_naive(session_id: str, turns: Sequence[TurnPlan]) -> SessionRun:
    run = SessionRun(session_id)
    items: list[_Held] = []
    shed_before = False
    for p in turns:
        occ = SYSTEM + sum(i.tokens for i in items)
        expected = p.generation * (STALE if shed_before else 1)
        t_out = int(expected * OUTPUT_MARGIN)
        rec = TurnRecord(p.turn, retrieval=False)
        # Candidates with (latency estimate, real latency, tokens); ranked by estimated
        # latency per token, compaction amortized over the turns it should last.
        old: list[_Held] = []
        summary = 0
        if occ > H:
            # the history before the last turn, and every earlier summary
            old = [i for i in items if i.turn < p.turn - 1 or i.id.startswith("sum-")]
            summary = summary_tokens(session_id, p.turn, [(i.id, i.tokens) for i in old])
        ret_tokens = sum(p.chunks)
        ops: list[tuple[float, str, float, int]] = []
        if old:
            saved = max(1, sum(i.tokens for i in old) - summary)
            real = compaction_ms(sum(i.tokens for i in old))
            ops.append((real / AMORTIZE_TURNS / saved, "compaction", real, summary))
        ops.append((RECALL_MS / p.recall, "recall", RECALL_MS, p.recall))
        ret_ms = RETRIEVAL_MS + prefill_ms(ret_tokens)
        ops.append((ret_ms / ret_tokens, "retrieval", ret_ms, ret_tokens))
        ops.sort()
        used, est = occ, BASE_MS + prefill_ms(occ) + GEN_MS_PER_TOKEN * expected
        real_ms = BASE_MS
        admitted: set[str] = set()
        for _, name, lat, tokens in ops:
            if name == "compaction":  # synchronous, in the turn: applied before the rest
                admitted.add(name)
                gone = {i.id for i in old}
                items = [i for i in items if i.id not in gone]
                items.append(_Held(f"sum-{p.turn}", summary, p.turn))
                used = SYSTEM + sum(i.tokens for i in items)
                est += lat / AMORTIZE_TURNS
                real_ms += lat
                rec.compaction_ms = lat
                rec.compaction = True
                rec.post_compaction = used
                run.count("compactions")
                if used > H:
                    run.count("failed_compactions")  # unchecked: nobody looks
                continue
            # the record's literal check: occupancy_current + t + t_output <= B
            if used + p.message + tokens + t_out > WINDOW:
                if name == "retrieval":
                    rec.refusal, rec.headroom_ms = "token_budget_exhausted", SLO_MS - est
                run.count(f"{name}_refused_token_budget_exhausted")
                continue
            if est + lat > SLO_MS:  # the per-turn latency check
                if name == "retrieval":
                    rec.refusal, rec.headroom_ms = "latency", SLO_MS - est
                run.count(f"{name}_refused_latency")
                continue
            admitted.add(name)
            used += tokens
            est += lat
        prompt = SYSTEM + sum(i.tokens for i in items) + p.message
        items.append(_Held(f"m{p.turn}", p.message, p.turn))
        if "recall" in admitted:
            items.append(_Held(f"r{p.turn}", p.recall, p.turn))
            prompt += p.recall
            real_ms += RECALL_MS
        rec.retrieval = "retrieval" in admitted
        if rec.retrieval:
            items.append(_Held(f"c{p.turn}", ret_tokens, p.turn))
            prompt += ret_tokens
            real_ms += RETRIEVAL_MS
        gen = p.generation * (1 if rec.retrieval else STALE)
        items.append(_Held(f"{'' if rec.retrieval else 'long-'}g{p.turn}", gen, p.turn))
        real_ms += prefill_ms(prompt) + GEN_MS_PER_TOKEN * gen
        rec.latency_ms = real_ms
        # Past the window the oldest history is dropped to fit; a summary is cut, not dropped.
        over = SYSTEM + sum(i.tokens for i in items) + t_out - WINDOW
        while over > 0:
            k = next((n for n, i in enumerate(items) if not i.id.startswith("sum-")), None)
            if k is None:
                items[0].tokens -= min(over, items[0].tokens)
            else:
                del items[k]
            over = SYSTEM + sum(i.tokens for i in items) + t_out - WINDOW
            run.count("history_truncated")
        shed_before = not rec.retrieval
        run.records.append(rec)
    return run


# --- the ledger ---------------------------------------------------------------------


def run_ledger(
    agent: SimAgent, turns: Sequence[TurnPlan], paced: bool = False, think_s: float = THINK_S
) -> SessionRun:
    """The session's turns through the agent layer. Autonomous (the default): each turn
    begins as the last one ends, the clock moved by the turn's own latency (at the demo's
    time scale), and every begin waits for a pending compaction, bounded by the agent
    layer's defaults (AUTONOMOUS_WAIT_S; the pickup bound likewise). `paced`: the
    human-paced variant (THINK_S, QUICK, COMPACTION_WAIT_S)."""
    run = SessionRun(agent.session.id)
    shed_before = False
    last_kn = 0
    due: Snapshot | None = None  # the snapshot at the end of a turn that made a compaction due
    state = {"rebuild": False, "tokens": 0, "items": 0}  # held at the last reading
    discarded: list[tuple[int, int]] = []
    core = agent.agent.core
    if not paced:
        core.await_compaction = AUTONOMOUS_WAIT_S
        core.compaction_pickup = agent.clock.pickup / TIME_SCALE
    for p in turns:
        if paced:
            if due is not None and not p.quick:
                # The user's think time: the worker compacts off the request path meanwhile.
                agent.wait_attempt(due, think_s)
            # A quick turn begins at once and does not wait: a pending compaction is still
            # pending, and the turn's admissions are judged against it (compaction_pending).
            core.await_compaction = 0.0 if p.quick else COMPACTION_WAIT_S
        refused = len(agent.refusals)
        agent.waited = False  # across the attempts of one turn
        waited_s = agent.waited_s
        for _attempt in range(64):
            try:
                rec, kn, due = _ledger_turn(agent, run, p, shed_before, last_kn, state)
                break
            except StaleEpoch:  # a hard reset by the worker: new epoch, empty context
                agent.adopt_reset()
                run.count("resets_seen")
                _discard(state, discarded)
            except WorkingMemoryStarvation as full:
                # The window is full and the turn cannot start (only without compaction
                # credit: with it, the hard reset comes first).
                try:
                    _make_room(agent, full, run)
                except StaleEpoch:  # the worker's hard reset came first
                    agent.adopt_reset()
                    run.count("resets_seen")
                    _discard(state, discarded)
        else:  # pragma: no cover - a turn starts after a few resets or cuts
            raise RuntimeError(f"turn {p.turn} of {run.session_id} could not run")
        state["rebuild"] = False
        rec.discarded, discarded = discarded, []
        rec.wait_ms = round((agent.waited_s - waited_s) * TIME_SCALE * 1000, 1)  # deployed
        if not paced:
            # An autonomous agent's next turn begins as this one ends: the clock moves by
            # the turn's own latency (a wait at its begin moved it already), at the demo's
            # time scale; the worker compacts meanwhile, or turns later.
            agent.clock.sleep(rec.latency_ms / 1000 / TIME_SCALE)
        for exc in agent.refusals[refused:]:
            run.count(f"refused_{exc.reason}" + (f"_{exc.bound}" if exc.bound else ""))
        if agent.waited:  # waited for a compaction, in this attempt or one a reset cut short
            rec.waited = True
            rec.latency_ms += compaction_ms(H)
        last_kn = kn
        shed_before = not rec.retrieval
        run.records.append(rec)
    return run


def _discard(state: dict[str, int], discarded: list[tuple[int, int]]) -> None:
    """A hard reset: the items the session held at the agent's last reading are gone."""
    discarded.append((state["tokens"], state["items"]))
    state["rebuild"], state["tokens"], state["items"] = True, 0, 0


def _make_room(agent: SimAgent, full: WorkingMemoryStarvation, run: SessionRun) -> None:
    """What the naive arbiter does past the window: drop the oldest history the ledger
    names, and when only the summary is left, cut it by what is missing (the summary
    given back, a shorter one admitted in its place)."""
    old = [i for i in full.compact if not i.startswith("sum-")]
    if old:
        agent.session.release(WM, old)
        run.count("history_dropped", len(old))
        return
    held = [i for i in agent.session.ledger.items(agent.session.id) if i.consumer is WM]
    item = next((i for i in held if i.id in full.compact), held[0] if held else None)
    if item is None:  # pragma: no cover - a full window holds working memory
        raise RuntimeError(f"{run.session_id}: the window is full of nothing to drop")
    agent.session.release(WM, [item.id])
    left = item.tokens - max(1, full.shortfall)
    if left > 0 and item.id.startswith("sum-"):
        try:
            agent.session.admit(WM, [Item(f"{item.id.split('.')[0]}.{run.count_of('cuts')}", left)])
        except AdmissionRefused:
            # The worker's compaction filled the window again between the refusal and
            # the cut: the shorter summary is not kept, the next attempt looks again.
            run.count("cuts_refused")
    run.count("cuts")


def _ledger_turn(
    agent: SimAgent,
    run: SessionRun,
    p: TurnPlan,
    shed_before: bool,
    last_kn: int,
    state: dict[str, int],
) -> tuple[TurnRecord, int, Snapshot | None]:
    expected = p.generation * (STALE if shed_before else 1)
    t = agent.begin(1_000, int(expected * OUTPUT_MARGIN))
    rec = TurnRecord(p.turn, retrieval=False, reset=bool(state["rebuild"]))
    start = round(t.utilization * WINDOW)
    agent.admit(WM, [Doc(f"m{p.turn}", p.message)])
    recall = agent.admit(REC, [Doc(f"r{p.turn}", p.recall)])
    chunks = [Doc(f"c{p.turn}-{k}", c) for k, c in enumerate(p.chunks)]
    ret = agent.admit(RET, chunks)
    rec.retrieval = bool(ret.kept)
    rec.refused_tokens = sum(d.tokens for d in ret.refused)
    if not ret.kept:
        rec.refusal = ret.reason
        if agent.refusals and agent.refusals[-1].reason == ret.reason:
            rec.bound = agent.refusals[-1].bound
    gen = p.generation * (1 if ret.kept else STALE)
    if not agent.admit(WM, [Doc(f"{'' if ret.kept else 'long-'}g{p.turn}", gen)]).kept:
        run.count("generation_refused")  # the reserve covered it; counted if it ever does not
    snap = agent.snapshot()
    kn = snap.raw.get(schema.COMPACTIONS_DONE, 0)
    state["tokens"], state["items"] = sum(snap.used.values()), sum(snap.items.values())
    if kn > last_kn:
        rec.compaction, rec.post_compaction = True, start
    prompt = max(1, snap.occupancy - gen)
    rec.latency_ms = (
        BASE_MS
        + prefill_ms(prompt)
        + (RECALL_MS if recall.kept else 0.0)
        + (RETRIEVAL_MS if ret.kept else 0.0)
        + GEN_MS_PER_TOKEN * gen
        + (REBUILD_MS if rec.reset else 0.0)
    )
    report = agent.end(prompt)
    return rec, kn, snap if report.compaction_due else None
