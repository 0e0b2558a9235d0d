"""Scenario 004, fan-out: memory-tool fragmentation behind a falling utilization gauge.

The scenario's conditions on a 32k window, 60 turns a session: the memory-tool fan-out
per turn grows from 4 to 23 spans (recall spans re-injecting a 6-8k snippet each,
serialized), while a summarizer shrinks the final prompt from 0.61 to 0.44 of the
window. Turn latency: 300 ms + 300 ms a span; the p99 trend is that of the last ten
turns against the ten before. The naive operator watches the utilization gauge
(alert above the 0.90 eviction threshold). The ledger's agent accounts every span
before making the call (``record_span``, whose guard says summarize and proceed past
the pathological threshold) and closes each turn with its final prompt and the p99
trend. A control run keeps the fan-out at 2 spans of 5k with a growing prompt
(0.44 to 0.61): saturation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ledger.client import Ledger
from ledger.fleet.agent import Doc, SimAgent
from ledger.models import Consumer, SessionBudget

WM = Consumer.WORKING_MEMORY
SESSIONS, TURNS = 2, 60
ALERT = 0.90
BUDGET = SessionBudget(window=32_000, system_prompt=2_100, output_reserve=1_024)


@dataclass(frozen=True, slots=True)
class TurnPlan:
    turn: int
    spans: tuple[int, ...]  # input tokens of each recall span
    final_prompt: int


def plan(seed: int, index: int, control: bool = False) -> tuple[TurnPlan, ...]:
    rng = random.Random(seed * 15_485_863 + index * 2 + control)
    w = BUDGET.window
    out = []
    for t in range(1, TURNS + 1):
        x = (t - 1) / (TURNS - 1)
        if control:
            spans = tuple(rng.randint(4_500, 5_500) for _ in range(2))
            final = round(w * (0.44 + 0.17 * x)) + rng.randint(0, 40)
        else:
            spans = tuple(rng.randint(6_000, 8_000) for _ in range(round(4 + 19 * x)))
            final = round(w * (0.61 - 0.17 * x)) - rng.randint(0, 40)
        out.append(TurnPlan(t, spans, final))
    return tuple(out)


@dataclass
class TurnRow:
    turn: int
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
    calls: int = 0
    session_ids: list[str] = field(default_factory=list)


def _latency(spans: int) -> float:
    return 300.0 + 300.0 * spans


def _p99(latencies: list[float]) -> float:
    last = sorted(latencies[-10:])
    return last[min(len(last) - 1, round(0.99 * (len(last) - 1)))]


def _trend(latencies: list[float]) -> int:
    if len(latencies) < 20:
        return 0
    now, before = _p99(latencies), _p99(latencies[:-10])
    return 1 if now > before else -1 if now < before else 0


def run_naive(turns: tuple[TurnPlan, ...]) -> list[TurnRow]:
    rows, lat = [], []
    for p in turns:
        lat.append(_latency(len(p.spans)))
        util = p.final_prompt / BUDGET.window
        rows.append(TurnRow(p.turn, sum(p.spans) / p.final_prompt, util, _p99(lat), util > ALERT))
    return rows


def run_ledger(agent: SimAgent, turns: tuple[TurnPlan, ...]) -> list[TurnRow]:
    rows: list[TurnRow] = []
    lat: list[float] = []
    held: list[Doc] = []
    for p in turns:
        agent.begin(1_000)
        ctx = Doc(f"ctx{p.turn}", p.final_prompt - BUDGET.system_prompt)  # the summarized context
        agent.release(held)
        agent.admit(WM, [ctx])
        held = [ctx]
        made, stops = 0, 0
        for k, tokens in enumerate(p.spans):
            if not agent.span("recall", tokens, 300):
                stops = len(p.spans) - k  # summarize and proceed: the rest is not made
                break
            made += 1
        lat.append(_latency(made))
        report = agent.end(p.final_prompt, _trend(lat))
        rows.append(
            TurnRow(
                p.turn,
                report.ratio,
                report.utilization,
                _p99(lat),
                classification=report.classification,
                guard_stops=stops,
            )
        )
    return rows


def run(ledger: Ledger, seed: int, tag: str) -> Result:
    out = Result()
    for i in range(SESSIONS):
        for control in (False, True):
            turns = plan(seed, i, control)
            sid = f"fanout-{seed}-{i}{'-control' if control else ''}@{tag}"
            agent = SimAgent(ledger, sid, BUDGET)
            rows = run_ledger(agent, turns)
            if control:
                out.control += rows
            else:
                out.naive += run_naive(turns)
                out.ledger += rows
            out.calls += agent.calls
            out.session_ids.append(sid)
    return out
