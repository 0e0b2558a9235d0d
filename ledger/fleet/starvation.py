"""Scenario 000, starvation: working memory starved while total use looks healthy.

The scenario's conditions (docs/demo.md), on a 40k window with a 2.1k system prompt: each turn's
query pulls 12-18 chunks of ~400 tokens (~6k) and the retriever keeps earlier sets
"for reference" up to its own 11k prefetch budget; tool output (2.5-4k a turn) is kept
in the scratchpad up to 9k; a synthesis turn reserves 14.5-16k for its answer and
declares a working set of 5.5-6.5k (one turn in five, a larger step of 12.5-14.5k).
Retrieval and scratchpad are sticky (written by policy, released by no reasoning step).

The naive arbiter gives working memory what is left and watches total utilization
against the 0.90 eviction threshold only. It also runs with one consumer released
each turn (not sticky): the record's condition 2 gone, starvation should then be
transient (the big steps only), and whether it is, is measured. The ledger's agent keeps the same
retention policies; ``begin_turn`` compares the residual against the declared
working set, classes the turn, and reclaims scratchpad, then stale retrieval.

What a turn short of its working set does (:func:`consequences`, the same draws under
every arbiter): the agent holds what fits of its working set and forgets the rest.
The working set is units of ``UNIT`` tokens: the plan of the synthesis under way, and
digests of what earlier steps established, each a tool result's (in the share of tool
output among the turn's tool output and retrieval) or a fact. Each unit is forgotten
with probability the turn's shortfall (1 - held / working set): a forgotten fact is
re-stated (repetition), a forgotten tool result is a tool call issued again (its result
costs its tokens and a turn again), a forgotten plan loses the thread: the synthesis
under way (the steps up to the next large step, the synthesis itself) is left
unfinished. What the cure costs: an item the ledger reclaimed from the turn just
before (the material the step builds on; older items are stale) is fetched again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from ledger import schema
from ledger.client import Ledger
from ledger.errors import WorkingMemoryStarvation
from ledger.fleet.agent import Doc, SimAgent
from ledger.fleet.decay import unit
from ledger.models import Consumer, SessionBudget

WM, RET, SCR = Consumer.WORKING_MEMORY, Consumer.RETRIEVAL, Consumer.SCRATCHPAD
SESSIONS, TURNS = 6, 30
RETRIEVAL_KEEP, SCRATCHPAD_KEEP = 11_000, 9_000  # the sticky pools' own budgets
BUDGET = SessionBudget(
    window=40_000,
    system_prompt=2_100,
    tool_framing=150,
    working_memory_floor=1_000,
    output_reserve=14_500,
)
FIXED = BUDGET.system_prompt + BUDGET.tool_framing
LARGE_STEP = 10_000  # a working set above this is one of the large synthesis steps
UNIT = 500  # a unit of the working set: the plan, a fact, or a tool result's digest


@dataclass(frozen=True, slots=True)
class TurnPlan:
    turn: int
    working_set: int
    output: int  # the answer's reserve
    chunks: tuple[int, ...]
    tool: int


def plan(seed: int, index: int) -> tuple[TurnPlan, ...]:
    rng = random.Random(seed * 7_919 + index)
    return tuple(
        TurnPlan(
            t,
            rng.randint(12_500, 14_500) if rng.random() < 0.2 else rng.randint(5_500, 6_500),
            rng.randint(14_500, 16_000),
            tuple(rng.randint(340, 460) for _ in range(rng.randint(12, 18))),
            rng.randint(2_500, 4_000),
        )
        for t in range(1, TURNS + 1)
    )


@dataclass
class TurnRow:
    turn: int
    working_set: int
    residual: int  # residual working memory when the turn's prompt is built
    utilization: float
    regime: str  # naive: silent | loud | ok; ledger: begin_turn's regime
    reclaimed: tuple[str, ...] = ()  # ledger: 's:<id>' / 'r:<id>', in order
    repeated: int = 0  # facts forgotten and stated again
    reissued: int = 0  # tool calls issued again (their results forgotten)
    reissued_tokens: int = 0  # what those results cost again
    lost_plan: bool = False  # the plan forgotten: the synthesis under way is unfinished
    fetched_again: int = 0  # ledger: reclaimed items of the turn before, fetched again
    fetched_again_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Forgetting:
    repeated: int
    reissued: int
    reissued_tokens: int
    lost_plan: bool


def consequences(key: str, p: TurnPlan, residual: int) -> Forgetting:
    """What the turn does with `residual` tokens of working memory: the units of its
    working set it cannot hold are forgotten (drawn per unit by `key`, the session's)."""
    held = max(0, min(p.working_set, residual))
    short = 1 - held / p.working_set
    tool_share = p.tool / (p.tool + sum(p.chunks))
    repeated = reissued = tokens = 0
    lost_plan = False
    for k in range(-(-p.working_set // UNIT)):
        if unit("lost", key, p.turn, k) >= short:
            continue
        if k == 0:
            lost_plan = True
        elif unit("kind", key, p.turn, k) < tool_share and reissued < p.turn - 1:
            # a digest of one of the calls of the turns before (one each)
            reissued += 1  # the same call's result, 2.5-4k as the turn's tool output
            tokens += 2_500 + round(1_500 * unit("size", key, p.turn, k))
        else:
            repeated += 1
    return Forgetting(repeated, reissued, tokens, lost_plan)


def _row(key: str, p: TurnPlan, residual: int, util: float, regime: str, **kw: Any) -> TurnRow:
    f = consequences(key, p, residual)
    return TurnRow(
        p.turn,
        p.working_set,
        residual,
        util,
        regime,
        repeated=f.repeated,
        reissued=f.reissued,
        reissued_tokens=f.reissued_tokens,
        lost_plan=f.lost_plan,
        **kw,
    )


def syntheses(rows: list[TurnRow]) -> tuple[int, int]:
    """(finished, attempted) syntheses of one session's rows: a synthesis is the steps
    up to and including a large step; it is unfinished when its plan was forgotten at
    one of them. The steps after a session's last large step are not counted."""
    done = tried = 0
    lost = False
    for r in rows:
        lost = lost or r.lost_plan
        if r.working_set >= LARGE_STEP:
            tried += 1
            done += not lost
            lost = False
    return done, tried


@dataclass
class Result:
    naive: list[TurnRow] = field(default_factory=list)
    # the naive arbiter with one consumer released each turn (not sticky)
    naive_loose: dict[str, list[TurnRow]] = field(
        default_factory=lambda: {"retrieval": [], "scratchpad": []}
    )
    ledger: list[TurnRow] = field(default_factory=list)
    off: list[TurnRow] | None = None  # the ledger without its rule (ledger/fleet/variants.py)
    calls: int = 0
    session_ids: list[str] = field(default_factory=list)


def _keep(pool: list[tuple[str, int]], cap: int) -> list[tuple[str, int]]:
    """The pool's own retention: drop its oldest beyond its budget (what it releases)."""
    while sum(t for _, t in pool) > cap:
        pool = pool[1:]
    return pool


def run_naive(
    turns: tuple[TurnPlan, ...], released: str | None = None, key: str = ""
) -> list[TurnRow]:
    """`released`: the consumer (retrieval or scratchpad) that is not sticky: it holds
    only this turn's own tokens. `key`: the session's draws of what is forgotten."""
    ret: list[tuple[str, int]] = []
    scr: list[tuple[str, int]] = []
    rows = []
    for p in turns:
        held = sum(t for _, t in ret) + sum(t for _, t in scr)
        residual = BUDGET.window - FIXED - p.output - held  # working memory gets the rest
        wm = max(0, min(p.working_set, residual))
        util = (FIXED + held + wm) / BUDGET.window
        regime = "loud" if util >= BUDGET.eviction_threshold else "ok"
        if regime == "ok" and residual < p.working_set:
            regime = "silent"  # the arbiter watches the ceiling only: nothing is raised
        rows.append(_row(key, p, residual, util, regime))
        ret = _keep(ret + [(f"c{p.turn}-{k}", c) for k, c in enumerate(p.chunks)], RETRIEVAL_KEEP)
        scr = _keep([*scr, (f"tool{p.turn}", p.tool)], SCRATCHPAD_KEEP)
        if released == "retrieval":
            ret = [(i, t) for i, t in ret if i.startswith(f"c{p.turn}-")]
        elif released == "scratchpad":
            scr = scr[-1:]
    return rows


def run_ledger(
    agent: SimAgent, turns: tuple[TurnPlan, ...], rule: bool = True, key: str = ""
) -> list[TurnRow]:
    """The same turns and retention policies; working memory is the turn's declared
    working set, gated by begin_turn (no item of its own). Without the rule the agent
    declares none: begin_turn judges and reclaims nothing. An item reclaimed from the
    turn just before is fetched again (its tokens counted; not put back in a pool)."""
    ret: list[Doc] = []
    scr: list[Doc] = []
    rows = []
    for p in turns:
        try:
            t = agent.begin(p.working_set if rule else 0, p.output)
        except WorkingMemoryStarvation as exc:  # pragma: no cover - reclamation suffices here
            rows.append(TurnRow(p.turn, p.working_set, exc.residual, exc.utilization, "refused"))
            continue
        gone = {
            i for _, i in (*t.reclaimed, *t.dropped)
        }  # what the ledger reclaimed leaves the prompt
        before = {d.id: d.tokens for d in (*ret, *scr)}
        ret = [d for d in ret if d.id not in gone]
        scr = [d for d in scr if d.id not in gone]
        reclaimed = tuple(schema.content_field(c.code, i) for c, i in t.reclaimed)
        again = [
            before.get(i, 0)
            for _, i in t.reclaimed
            if i in (f"tool{p.turn - 1}",) or i.startswith(f"c{p.turn - 1}-")
        ]
        rows.append(
            _row(
                key,
                p,
                t.residual,
                t.utilization,
                t.regime,
                reclaimed=reclaimed,
                fetched_again=len(again),
                fetched_again_tokens=sum(again),
            )
        )
        chunks = [Doc(f"c{p.turn}-{k}", c) for k, c in enumerate(p.chunks)]
        kept = _keep_docs(ret + chunks, RETRIEVAL_KEEP)
        agent.release([d for d in ret if d not in kept])
        got = agent.admit(RET, [d for d in chunks if d in kept])
        ret = [d for d in kept if d not in chunks or d in got.kept]
        res = agent.tool_result(Doc(f"tool{p.turn}", p.tool))
        ret = [d for d in ret if d not in res.evicted]  # memory that gave way to the result
        held = [*scr, res.result] if res.charged else scr
        kept_s = _keep_docs(held, SCRATCHPAD_KEEP)
        agent.release([d for d in scr if d not in kept_s])
        scr = kept_s
        agent.end(max(1, agent.snapshot().occupancy))
    return rows


def _keep_docs(pool: list[Doc], cap: int) -> list[Doc]:
    while sum(d.tokens for d in pool) > cap:
        pool = pool[1:]
    return pool


def run(ledger: Ledger, seed: int, tag: str, rule: bool = True, off: bool = True) -> Result:
    """Naive and ledger (`rule`: with its rule) on each session; `off`: the ledger
    without its rule too."""
    out = Result(off=[] if off else None)
    for i in range(SESSIONS):
        turns = plan(seed, i)
        key = f"starvation-{seed}-{i}"  # what is forgotten: the same draws everywhere
        out.naive += run_naive(turns, key=key)
        for consumer, loose in out.naive_loose.items():
            loose += run_naive(turns, released=consumer, key=key)
        for with_rule, rows in ((rule, out.ledger), (False, out.off)):
            if rows is None:
                continue
            sid = f"starvation-{seed}-{i}{'' if with_rule else '-off'}@{tag}"
            agent = SimAgent(ledger, sid, BUDGET)
            rows += run_ledger(agent, turns, with_rule, key)
            out.calls += agent.calls
            out.session_ids.append(sid)
    return out
