"""Scenario 004, fan-out: memory-tool fragmentation behind a falling utilization gauge.

The scenario's conditions on a 32k window, 60 turns a session. The agent runs a
memory-tool call graph each turn, its spans one after another (each recall's query
depends on what the one before returned): it needs NEED tokens of relevant memory, so
it recalls (each span re-injecting a 6-8k snippet) until what it recalled covers that
need, then a summarize span compresses the union into the final prompt, and the model
call answers on it. The memory layer compacts: every summarize writes its union back
and prunes the sources, and each source folded into a summary costs the memory a share
of its relevance (0.28-0.45% a source, drawn): the more recalls a turn makes, the more
the next turn needs. So the spans per turn, the final prompt, the amplification ratio
(the recall spans' input over the final prompt) and the latency follow from the loop;
nothing is a function of the turn number. Each span's latency is drawn (per session,
turn and span, the same draws under every arbiter) from a lognormal around a cost in
proportion to what it reads; the turn's latency is the sum along the graph. The naive
operator watches the utilization gauge (alert above the 0.90 eviction threshold). The
ledger's agent accounts every recall span before making the call (``record_span``,
whose guard says summarize and proceed past the pathological threshold) and closes
each turn with its final prompt and its p99 trend (the p99 of its last ten turns
against the ten before). A control run keeps 2 recalls of ~5k with a prompt that grows
(0.44 to 0.61, no compaction): saturation.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from statistics import NormalDist

from ledger.client import Ledger
from ledger.fleet.agent import Doc, SimAgent
from ledger.fleet.decay import unit
from ledger.models import Consumer, SessionBudget

WM = Consumer.WORKING_MEMORY
SESSIONS, TURNS = 6, 60
ALERT = 0.90
BUDGET = SessionBudget(window=32_000, system_prompt=2_100, output_reserve=1_024)
# without the rule: a pathological threshold out of reach, so the guard never says stop
UNGUARDED = SessionBudget(**{**BUDGET.model_dump(), "amplification_pathological": 1_000.0})
NEED = 14_000  # relevant memory a turn needs
RELEVANT_0 = 0.55  # share of a snippet that is relevant, before any compaction
DILUTION = (0.0028, 0.0045)  # share of relevance each source folded into a summary costs
MAX_RECALLS = 40  # the memory returns no more snippets than this in one turn
CONTEXT = (5_100, 5_500)  # the turn's own context besides the summary
SUMMARY_MAX, UNION_0 = 12_000, 28_000  # the summarizer: 12k of a 28k union, less of more
# span latency, seconds: (fixed, per 1k tokens read, lognormal sigma)
RECALL = (0.18, 0.02, 0.35)  # a recall: the lookup, then the snippet it reads
SUMMARIZE = (0.10, 0.005, 0.2)  # the summarize span over the union
MODEL = (1.1, 0.03, 0.08)  # the turn's model call on its final prompt
EARLY, LATE = (1, 10), (TURNS - 9, TURNS)  # the windows the figures are read over
_Z = NormalDist()


@dataclass(frozen=True, slots=True)
class TurnRow:
    turn: int
    spans: int  # spans of the turn's call graph: its recalls and the summarize span
    ratio: float  # recall span input / final prompt (docs/rules.md#amplification)
    utilization: float
    latency_ms: float  # the turn's: the sum of its spans' and its model call's
    p99_ms: float  # of the session's last ten turns (the trend the agent reports)
    alert: bool = False  # naive: the gauge raised something
    classification: str = ""  # ledger
    guard_stops: int = 0  # ledger: spans the guard turned into summarize-and-proceed
    summarize_ms: float = 0.0  # the turn's summarize span (in latency_ms)


@dataclass
class Result:
    naive: list[TurnRow] = field(default_factory=list)
    ledger: list[TurnRow] = field(default_factory=list)
    control: list[TurnRow] = field(default_factory=list)
    off: list[TurnRow] | None = None  # the ledger without its rule (ledger/fleet/variants.py)
    calls: int = 0
    session_ids: list[str] = field(default_factory=list)


class Memory:
    """The memory layer of one session: recall snippets whose relevance each compaction
    dilutes, and the summarizer that compresses a turn's union."""

    def __init__(self, seed: int, index: int, control: bool) -> None:
        self.rng = random.Random(seed * 15_485_863 + index * 2 + control)
        self.key = f"fanout-{seed}-{index}-{int(control)}"  # the latency draws
        self.control = control
        self.relevant = RELEVANT_0

    def snippet(self) -> int:
        return self.rng.randint(4_500, 5_500) if self.control else self.rng.randint(6_000, 8_000)

    def covers(self, recalled: list[int]) -> bool:
        """Whether `recalled` covers the turn's need (the control turn makes two recalls)."""
        if self.control:
            return len(recalled) >= 2
        return sum(recalled) * self.relevant >= NEED or len(recalled) >= MAX_RECALLS

    def summarize(self, recalled: list[int], turn: int) -> int:
        """The final prompt after the summarize span, tokens; memory is compacted: each
        source folded into the summary dilutes what the memory holds."""
        context = self.rng.randint(*CONTEXT)
        if self.control:  # no compaction: the conversation grows (0.44 -> 0.61)
            x = (turn - 1) / (TURNS - 1)
            return round(BUDGET.window * (0.44 + 0.17 * x)) + self.rng.randint(0, 40)
        union = max(1, sum(recalled))
        summary = min(NEED, round(SUMMARY_MAX * math.pow(UNION_0 / union, 0.3)))
        for _ in recalled:  # written back, sources pruned
            self.relevant *= 1 - self.rng.uniform(*DILUTION)
        return BUDGET.system_prompt + context + summary

    def seconds(self, cost: tuple[float, float, float], tokens: int, *where: object) -> float:
        """One span's latency: its cost for `tokens` read, times a lognormal draw."""
        fixed, per_1k, sigma = cost
        u = min(max(unit("latency", self.key, *where), 1e-9), 1 - 1e-9)
        return (fixed + per_1k * tokens / 1000) * math.exp(sigma * _Z.inv_cdf(u))

    def latency_ms(self, turn: int, recalled: list[int], final: int) -> float:
        """The turn's latency: its spans one after another, then the model call."""
        s = sum(self.seconds(RECALL, x, turn, k) for k, x in enumerate(recalled))
        s += self.seconds(SUMMARIZE, sum(recalled), turn, "summarize")
        return 1000 * (s + self.seconds(MODEL, final, turn, "model"))

    def summarize_ms(self, turn: int, recalled: list[int]) -> float:
        """The turn's summarize span's latency (a part of :meth:`latency_ms`)."""
        return 1000 * self.seconds(SUMMARIZE, sum(recalled), turn, "summarize")


def _p99(latencies: list[float]) -> float:
    """Nearest-rank p99 of the last ten turns."""
    last = sorted(latencies[-10:])
    return last[math.ceil(0.99 * len(last)) - 1]


def _trend(latencies: list[float]) -> int:
    if len(latencies) < 20:
        return 0
    now, before = _p99(latencies), _p99(latencies[:-10])
    return 1 if now > before else -1 if now < before else 0


def run_naive(seed: int, index: int) -> list[TurnRow]:
    """The same agent and memory layer, no guard; the operator watches utilization."""
    memory, rows, lat = Memory(seed, index, False), [], []
    for t in range(1, TURNS + 1):
        recalled: list[int] = []
        while not memory.covers(recalled):
            recalled.append(memory.snippet())
        final = memory.summarize(recalled, t)
        lat.append(memory.latency_ms(t, recalled, final))
        util = final / BUDGET.window
        rows.append(
            TurnRow(
                t,
                len(recalled) + 1,
                sum(recalled) / final,
                util,
                lat[-1],
                _p99(lat),
                util > ALERT,
                summarize_ms=memory.summarize_ms(t, recalled),
            )
        )
    return rows


def run_ledger(agent: SimAgent, seed: int, index: int, control: bool = False) -> list[TurnRow]:
    memory = Memory(seed, index, control)
    rows: list[TurnRow] = []
    lat: list[float] = []
    held: list[Doc] = []
    for t in range(1, TURNS + 1):
        agent.begin(1_000)
        if not held:  # the session's opening context, before the first turn's spans
            held = [Doc("ctx0", SUMMARY_MAX + CONTEXT[0])]
            agent.admit(WM, held)
        recalled: list[int] = []
        stopped = False
        while not memory.covers(recalled):
            tokens = memory.snippet()
            if not agent.span("recall", tokens, 300):
                stopped = True  # summarize and proceed with what was recalled
                break
            recalled.append(tokens)
        final = memory.summarize(recalled, t)
        ctx = Doc(f"ctx{t}", final - BUDGET.system_prompt)  # the summarized context
        agent.release(held)
        agent.admit(WM, [ctx])
        held = [ctx]
        lat.append(memory.latency_ms(t, recalled, final))
        report = agent.end(final, _trend(lat))
        rows.append(
            TurnRow(
                t,
                len(recalled) + 1,
                report.ratio,
                report.utilization,
                lat[-1],
                _p99(lat),
                classification=report.classification,
                guard_stops=int(stopped),
                summarize_ms=memory.summarize_ms(t, recalled),
            )
        )
    return rows


def run(ledger: Ledger, seed: int, tag: str, rule: bool = True, off: bool = True) -> Result:
    """Naive, ledger (`rule`: with its rule) and its control on each session; `off`: the
    ledger without its rule too."""
    out = Result(off=[] if off else None)
    for i in range(SESSIONS):
        runs = [("", False, rule, out.ledger), ("-control", True, rule, out.control)]
        if out.off is not None:
            runs.append(("-off", False, False, out.off))
        out.naive += run_naive(seed, i)
        for suffix, control, with_rule, rows in runs:
            sid = f"fanout-{seed}-{i}{suffix}@{tag}"
            agent = SimAgent(ledger, sid, BUDGET if with_rule else UNGUARDED)
            rows += run_ledger(agent, seed, i, control)
            out.calls += agent.calls
            out.session_ids.append(sid)
    return out
