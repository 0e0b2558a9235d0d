"""Does scenario 001 depend on the pending-compaction bound? (issue 43)

    python -m bench.pending_credit [--regime demo|no-think|late] [--fleet 8,4] [SEED ...]

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

Regimes: ``demo``, the scenario as ``ledger demo`` runs it; ``no-think``, the simulated
user never thinks (the agent still waits, bounded, for a pending compaction at a begin);
``late``, the agent never pauses at all (no think time, no wait at a begin) and the
clock moves by each turn's own latency (at the demo's 1/50), so a compaction lands turns
after it was requested; ``late-wait``, the same clock, but the agent keeps the library's
wait at a begin (``await_compaction``, the demo's share of quick turns that skip it).
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
def regime(name: str, wait_s: float | None = None) -> Iterator[None]:
    """`wait_s`: the agent's bound on waiting at a begin, in a deployment's seconds (the
    clock's 1/50 applied), in place of the demo's 7.5 s (decay.COMPACTION_WAIT_S)."""
    if wait_s is not None:
        with mock.patch.object(decay, "COMPACTION_WAIT_S", wait_s / 50), regime(name):
            yield
        return
    if name == "demo":
        yield
        return
    run_ledger, ledger_turn = decay.run_ledger, decay._ledger_turn

    def no_think(agent: SimAgent, turns: Sequence[decay.TurnPlan], think_s: float = 0.0) -> Any:
        return run_ledger(agent, turns, 0.0)

    def timed_turn(agent: SimAgent, *args: Any) -> Any:
        out = ledger_turn(agent, *args)
        agent.clock.sleep(out[0].latency_ms / 1000 / 50)  # the turn's own time, at 1/50
        return out

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(decay, "run_ledger", no_think))
        if name in ("late", "late-wait"):
            if name == "late":
                stack.enter_context(mock.patch.object(decay, "QUICK", 1.0))  # no wait at a begin
            stack.enter_context(mock.patch.object(decay, "_ledger_turn", timed_turn))
        yield


def measure(
    seed: int, fleet: tuple[int, int], admit: str, name: str, wait_s: float | None = None
) -> dict[str, Any]:
    stats: Counter[str] = Counter()
    margins: list[int] = []
    config = FleetConfig(
        seed=seed,
        only=frozenset({"001"}),
        sessions=fleet[0],
        tail=fleet[1],
        scripts={"admit": admit},
    )
    settings = LedgerSettings(redis_url="embedded://", prefix=f"pc{uuid.uuid4().hex[:8]}")
    with regime(name, wait_s), probed(stats, margins):
        lg = report.summarize(run(settings, config))["ledger"]
    return {
        "summary": lg,
        "stats": dict(stats),
        "least margin": min(margins, default=None),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("seeds", nargs="*", type=int, default=[1, 11, 23])
    ap.add_argument("--regime", choices=("demo", "no-think", "late", "late-wait"), default="demo")
    ap.add_argument("--fleet", default="8,4", help="sessions,tail sessions (default 8,4)")
    ap.add_argument(
        "--wait",
        type=float,
        default=None,
        help="the agent's wait at a begin, a deployment's seconds (default: the demo's 7.5)",
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
