"""Scenario 004, fan-out: memory-tool fragmentation behind a falling utilization gauge.

The scenario's conditions on a 32k window, 60 turns a session. The agent runs a
memory-tool call graph each turn: it needs NEED tokens of relevant memory, so it
recalls (serialized spans, each re-injecting a 6-8k snippet) until what it recalled
covers that need, then a summarize span compresses the union into the final prompt.
The memory layer compacts: every summarize writes its union back and prunes the
sources, so each entry keeps a little less of what a later query needs (2-4% a turn,
drawn by the seed). The spans per turn, the final prompt, the amplification ratio and
the p99 all follow from that loop: more recalls to cover the same need, a harder
squeeze by the summarizer of a larger union, a smaller prompt. Turn latency: 1.9 s +
0.33 s a span (the spans are serialized); the p99 trend is that of the last ten turns
against the ten before. The naive operator watches the utilization gauge (alert
above the 0.90 eviction threshold). The ledger's agent accounts every span before
making the call (``record_span``, whose guard says summarize and proceed past the
pathological threshold) and closes each turn with its final prompt and the p99
trend. A control run keeps 2 recalls of ~5k with a prompt that grows (0.44 to
0.61, no compaction): saturation.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from ledger.client import Ledger
from ledger.fleet.agent import Doc, SimAgent
from ledger.models import Consumer, SessionBudget

WM = Consumer.WORKING_MEMORY
SESSIONS, TURNS = 2, 60
ALERT = 0.90
BUDGET = SessionBudget(window=32_000, system_prompt=2_100, output_reserve=1_024)
# without the rule: a pathological threshold out of reach, so the guard never says stop
UNGUARDED = SessionBudget(**{**BUDGET.model_dump(), "amplification_pathological": 1_000.0})
NEED = 14_000  # relevant memory a turn needs
RELEVANT_0 = 0.55  # share of a snippet that is relevant, before any compaction
DILUTION = (0.02, 0.04)  # share of relevance each compaction of memory loses
CONTEXT = (5_100, 5_500)  # the turn's own context besides the summary
SUMMARY_MAX, UNION_0 = 12_000, 28_000  # the summarizer: 12k of a 28k union, less of more
BASE_S, SPAN_S = 1.9, 0.33


@dataclass(frozen=True, slots=True)
class TurnRow:
    turn: int
    spans: int  # recall spans made
    ratio: float  # span input / final prompt: amplification (docs/rules.md#amplification)
    utilization: float
    p99_ms: float
    alert: bool = False  # naive: the gauge raised something
    classification: str = ""  # ledger
    guard_stops: int = 0  # ledger: spans the guard turned into summarize-and-proceed


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
        self.control = control
        self.relevant = RELEVANT_0

    def snippet(self) -> int:
        return self.rng.randint(4_500, 5_500) if self.control else self.rng.randint(6_000, 8_000)

    def covers(self, recalled: list[int], k: int) -> bool:
        """Whether `recalled` covers the turn's need (the control turn makes two recalls)."""
        if self.control:
            return len(recalled) >= 2
        return sum(recalled) * self.relevant >= NEED

    def summarize(self, recalled: list[int], turn: int) -> int:
        """The final prompt after the summarize span, tokens; memory is compacted."""
        context = self.rng.randint(*CONTEXT)
        if self.control:  # no compaction: the conversation grows (0.44 -> 0.61)
            x = (turn - 1) / (TURNS - 1)
            return round(BUDGET.window * (0.44 + 0.17 * x)) + self.rng.randint(0, 40)
        union = max(1, sum(recalled))
        summary = min(NEED, round(SUMMARY_MAX * math.pow(UNION_0 / union, 0.3)))
        self.relevant *= 1 - self.rng.uniform(*DILUTION)  # written back, sources pruned
        return BUDGET.system_prompt + context + summary


def _latency_ms(spans: int) -> float:
    return 1000 * (BASE_S + SPAN_S * spans)


def _p99(latencies: list[float]) -> float:
    last = sorted(latencies[-10:])
    return last[min(len(last) - 1, round(0.99 * (len(last) - 1)))]


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
        while not memory.covers(recalled, len(recalled)):
            recalled.append(memory.snippet())
        final = memory.summarize(recalled, t)
        lat.append(_latency_ms(len(recalled)))
        util = final / BUDGET.window
        rows.append(TurnRow(t, len(recalled), sum(recalled) / final, util, _p99(lat), util > ALERT))
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
        while not memory.covers(recalled, len(recalled)):
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
        lat.append(_latency_ms(len(recalled)))
        report = agent.end(final, _trend(lat))
        rows.append(
            TurnRow(
                t,
                len(recalled),
                report.ratio,
                report.utilization,
                _p99(lat),
                classification=report.classification,
                guard_stops=int(stopped),
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
