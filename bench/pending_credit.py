"""Does scenario 001 depend on the pending-compaction bound? (issue 43)

    python -m bench.pending_credit [--regime demo|late|paced|no-think] [--fleet 8,4] [SEED ...]

Runs scenario 001's ledger column on embedded (the stepped clock: the same figures on
any machine) twice per seed: with the packaged ``admit.lua``, and with the bound taken
out where it lives (the line after ``-- rule: pending-compaction-bound``: no cap while
a compaction is pending, the bound of a failed compaction kept), as
tests/test_demo_rules.py takes rules out. Before each retrieval or recall admission it
reads the session (a snapshot: no call that moves the clock) and, when the admission is
judged under the pending bound (a compaction pending, the last one not failed), compares
the bound's room, W - out - HW - pm, with the free room: the bound can refuse only where
its room is the smaller. Prints per seed both columns' refusals and retrieval admission,
the count of admissions under the bound, the least (bound room - free room) among them,
and whether the ledger column's summary is the same without the bound.

Regimes: ``demo``, the scenario as ``ledger demo`` runs it: autonomous agents (no think
time, the clock moved by each turn's own latency at the demo's 1/50, so a compaction may
land turns after it was requested) that wait at a begin for a pending compaction,
bounded by the agent layer's defaults; ``late``, the same, but the agent never waits at
a begin (the other half of the credit, begin_turn.lua's ``pending-compaction-credit``
refusal, then never holds a turn); ``paced``, ``ledger demo --paced``: a simulated
user's think time between turns (the worker compacts meanwhile); ``no-think``, the paced
agent whose user never thinks (it still waits, bounded, at a begin). ``--wait S``: the
agent's bound on waiting at a begin, in a deployment's seconds (at 1/50), in place of
the regime's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

from ledger import LedgerSettings, scripts
from ledger.fleet import decay, report
from ledger.fleet.agent import Doc, SimAgent
from ledger.fleet.run import FleetConfig, run
from ledger.models import Consumer

MARKER = "pending-compaction-bound"
BOUND = "cap = tonumber(x[3]) - tonumber(x[2]) - base"


def without_bound() -> str:
    """admit.lua with the pending bound taken out where it lives."""
    lines = scripts.source("admit").split("\n")
    at = [i for i, line in enumerate(lines) if re.match(rf"\s*-- rule: {MARKER}\b", line)]
    assert len(at) == 1 and lines[at[0] + 1].count(BOUND) == 1, "admit.lua moved: follow it"
    lines[at[0] + 1] = lines[at[0] + 1].replace(BOUND, "cap = nil")
    return "\n".join(lines)


@contextlib.contextmanager
def probed(stats: Counter[str], margins: list[int]) -> Iterator[None]:
    """Each retrieval or recall admission of scenario 001's agents, read before it runs."""
    admit = SimAgent.admit

    def read_then_admit(self: SimAgent, consumer: Consumer, docs: Sequence[Doc]) -> Any:
        if consumer in (Consumer.RETRIEVAL, Consumer.RECALL):
            r = self.session.snapshot().raw
            stats["memory admissions"] += 1
            if r.get("cd") == 1:
                stats["while a compaction is pending"] += 1
                if not r.get("kf"):
                    stats["under the pending bound"] += 1
                    margins.append(r["W"] - r["out"] - r["HW"] - r.get("pm", 0) - r["fr"])
        return admit(self, consumer, docs)

    with mock.patch.object(SimAgent, "admit", read_then_admit):
        yield


@contextlib.contextmanager
def regime(name: str, wait_s: float | None = None) -> Iterator[bool]:
    """The regime's patches; yields whether the fleet is human-paced (FleetConfig.paced).
    `wait_s`: the agent's bound on waiting at a begin, in a deployment's seconds (the
    clock's 1/50 applied), in place of the regime's."""
    paced = name in ("paced", "no-think")
    with contextlib.ExitStack() as stack:
        if wait_s is not None:
            limit = "COMPACTION_WAIT_S" if paced else "AUTONOMOUS_WAIT_S"
            stack.enter_context(mock.patch.object(decay, limit, wait_s / decay.TIME_SCALE))
        if name == "late":
            stack.enter_context(mock.patch.object(decay, "AUTONOMOUS_WAIT_S", 0.0))
        if name == "no-think":
            run_ledger = decay.run_ledger

            def no_think(agent: SimAgent, turns: Sequence[decay.TurnPlan], paced: bool) -> Any:
                return run_ledger(agent, turns, paced, think_s=0.0)

            stack.enter_context(mock.patch.object(decay, "run_ledger", no_think))
        yield paced


def measure(
    seed: int, fleet: tuple[int, int], admit: str, name: str, wait_s: float | None = None
) -> dict[str, Any]:
    stats: Counter[str] = Counter()
    margins: list[int] = []
    settings = LedgerSettings(redis_url="embedded://", prefix=f"pc{uuid.uuid4().hex[:8]}")
    with regime(name, wait_s) as paced, probed(stats, margins):
        config = FleetConfig(
            seed=seed,
            only=frozenset({"001"}),
            sessions=fleet[0],
            tail=fleet[1],
            scripts={"admit": admit},
            paced=paced,
        )
        lg = report.summarize(run(settings, config))["ledger"]
    return {
        "summary": lg,
        "stats": dict(stats),
        "least margin": min(margins, default=None),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("seeds", nargs="*", type=int, default=[1, 11, 23])
    ap.add_argument("--regime", choices=("demo", "late", "paced", "no-think"), default="demo")
    ap.add_argument("--fleet", default="8,4", help="sessions,tail sessions (default 8,4)")
    ap.add_argument(
        "--wait",
        type=float,
        default=None,
        help="the agent's wait at a begin, a deployment's seconds (default: the regime's: "
        "2 autonomous, the agent layer's default; 7.5 paced)",
    )
    a = ap.parse_args(argv)
    logging.getLogger("ledger.worker").setLevel(logging.ERROR)
    sessions, tail = (int(x) for x in a.fleet.split(","))
    for seed in a.seeds:
        got = {
            label: measure(seed, (sessions, tail), text, a.regime, a.wait)
            for label, text in (("packaged", scripts.source("admit")), ("removed", without_bound()))
        }
        same = json.dumps(got["packaged"]["summary"], sort_keys=True) == json.dumps(
            got["removed"]["summary"], sort_keys=True
        )
        for label, m in got.items():
            lg = m["summary"]
            rates = " / ".join(
                f"{v['rate']:.2f}" if v["rate"] is not None else "n/a"
                for v in lg["retrieval_admission"].values()
            )
            print(
                f"{a.regime} seed {seed} {label}: retrieval {rates} at 10/60/120, "
                f"refusals {lg['refusals']}; {m['stats']}; "
                f"least (bound room - free room) {m['least margin']}"
            )
        print(f"{a.regime} seed {seed}: the ledger column the same without the bound: {same}")


if __name__ == "__main__":
    main()
