"""Seeded workloads drawn from the records' own numbers (pure, no I/O).

- retrieval injects 12-18 chunks of ~400 tokens per turn, with no release of
  earlier sets (a low relevance floor; record 000);
- tool results average ~6k tokens with a heavy tail, p99 ~28k (record 002), and
  are kept in the scratchpad "for reference" (record 000);
- sessions last a median of 40 turns, p99 210 (record 001), capped by max_turns;
- memory-tool fan-out per turn: a few recall spans, a fragmenting minority with
  many large ones (record 004);
- compactions use the worker's simulated summarizer, which compresses "on
  average": a soft post-condition (record 001).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ledger.models import SessionBudget

BUDGET = SessionBudget(
    window=32_000,
    system_prompt=2_100,
    tool_framing=150,
    working_memory_floor=4_000,
    min_memory=0,
    output_reserve=1_024,
    spill_preview_tokens=300,
)
SYSTEM_BOILERPLATE = 600  # what a naive allocator "compresses" away (the permission clause)


@dataclass(frozen=True, slots=True)
class TurnPlan:
    turn: int
    message: int  # working-memory tokens this turn adds (user message + reasoning)
    working_set: int  # tokens of state the turn must hold
    chunks: tuple[int, ...]  # retrieval chunk sizes
    tools: tuple[int, ...]  # parallel tool results of this turn
    spans: tuple[tuple[str, int, int], ...]  # memory-tool spans (kind, input, output)


@dataclass(frozen=True, slots=True)
class SessionPlan:
    session_id: str
    turns: tuple[TurnPlan, ...]
    fragmenting: bool


def _lognormal(rng: random.Random, median: float, p99: float) -> float:
    sigma = math.log(p99 / median) / 2.326
    return rng.lognormvariate(math.log(median), sigma)


def session_plan(seed: int, index: int, max_turns: int) -> SessionPlan:
    rng = random.Random(seed * 1_000_003 + index)
    n = max(3, min(max_turns, round(_lognormal(rng, 40, 210))))
    fragmenting = rng.random() < 0.25
    turns = []
    for t in range(1, n + 1):
        tools: tuple[int, ...] = ()
        if rng.random() < 0.45:
            k = 2 if rng.random() < 0.2 else 1
            tools = tuple(
                min(60_000, max(200, round(_lognormal(rng, 4_500, 28_000)))) for _ in range(k)
            )
        fan = rng.randint(6, 14) if fragmenting and rng.random() < 0.5 else rng.randint(0, 3)
        spans = tuple(("recall", rng.randint(500, 8_000), rng.randint(50, 400)) for _ in range(fan))
        turns.append(
            TurnPlan(
                turn=t,
                message=rng.randint(250, 900),
                working_set=rng.randint(3_000, 7_000),
                chunks=tuple(rng.randint(340, 460) for _ in range(rng.randint(12, 18))),
                tools=tools,
                spans=spans,
            )
        )
    return SessionPlan(f"fleet-{seed}-{index}", tuple(turns), fragmenting)
