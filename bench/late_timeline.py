"""Per-session timelines of scenario 001 under bench/pending_credit.py's regimes (issue 43).

    python -m bench.late_timeline [--regime late] [--session N] [--max-lines K] SEED

Runs the ledger column as bench.pending_credit does, and records on the stepped clock:
a turn's end that makes a compaction due, each worker pickup of a compaction job (the
snapshot it read: occupancy, high-water mark, failures kf, pending cd, reset requested
rq) and compact.lua's verdict (outcome, occupancy after, judged, gain), each hard reset,
and each refused retrieval with what the session held when it was refused. Prints the
outcome counts, the share of pickups by session, and one session's timeline.
"""

from __future__ import annotations

import argparse
import logging
import uuid
from collections import Counter, defaultdict
from typing import Any
from unittest import mock

from bench.pending_credit import regime
from ledger import LedgerSettings
from ledger.fleet import agent as fagent
from ledger.fleet import decay, report
from ledger.fleet.agent import SimAgent
from ledger.fleet.run import FleetConfig, run
from ledger.models import Consumer
from ledger.workers import calls as wcalls
from ledger.workers import jobs as wjobs

EV: list[dict[str, Any]] = []
CLOCK: list[Any] = [None]
TURN: dict[str, int] = {}


def now() -> float:
    c = CLOCK[0]
    return round(c.now, 3) if c is not None else -1.0


def short(sid: str) -> str:
    return sid.split("@")[0]


def raw_view(r: dict[str, Any]) -> dict[str, Any]:
    occ = r.get("S", 0) + r.get("T", 0) + r.get("a_w", 0) + r.get("a_rm", 0) + r.get("a_s", 0)
    return {k: r.get(k) for k in ("kf", "cd", "rq", "HW", "fr", "ep", "kn")} | {"occ": occ}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("seed", type=int)
    ap.add_argument("--regime", default="late")
    ap.add_argument("--session", type=int, default=None, help="index of a session to print")
    ap.add_argument("--max-lines", type=int, default=120)
    ap.add_argument("--wait", type=float, default=None, help="as bench.pending_credit --wait")
    a = ap.parse_args(argv)
    logging.getLogger("ledger.worker").setLevel(logging.ERROR)

    sleep0 = fagent.SteppedClock.sleep

    def sleep(self: Any, seconds: float) -> None:
        CLOCK[0] = self
        before = self.passes
        sleep0(self, seconds)
        if self.passes > before:
            EV.append({"t": now(), "kind": "pass", "sid": "", "busy_until": round(self.free_at, 3)})

    compact0 = wcalls.LedgerCalls.compact

    def compact(
        self: Any,
        keys: Any,
        op_id: str,
        epoch: int,
        replaced: Any,
        summary: Any,
        job: str,
        summary_text: Any = None,
        read: Any = None,
    ) -> Any:
        sid = keys.session_id
        done = compact0(self, keys, op_id, epoch, replaced, summary, job, summary_text, read)
        EV.append(
            {
                "t": now(),
                "kind": "commit",
                "sid": sid,
                "turn": TURN.get(sid),
                "outcome": str(getattr(done, "outcome", "?")).split(".")[-1],
                "n": len(replaced),
                "summary": summary.tokens if summary else 0,
                "done": {
                    k: getattr(done, k, None)
                    for k in (
                        "occupancy",
                        "high_water_mark",
                        "dropped",
                        "failures",
                        "escalated",
                        "gain",
                        "free",
                    )
                },
            }
        )
        return done

    cmp0 = wjobs.Jobs._compact

    def _compact(self: Any, job_id: str, f: Any) -> Any:
        sid = f.session
        try:
            r = self.calls.snapshot(self.calls.session_keys(sid)).raw
            seen = raw_view(r)
        except Exception as exc:
            seen = {"err": repr(exc)}
        out = cmp0(self, job_id, f)
        EV.append(
            {
                "t": now(),
                "kind": "pickup",
                "sid": sid,
                "turn": TURN.get(sid),
                "job_epoch": f.epoch,
                "reason": getattr(f, "reason", None),
                "seen": seen,
                "effect": str(out.effect).split(".")[-1],
            }
        )
        return out

    hr0 = wjobs.Jobs._hard_reset

    def _hard_reset(self: Any, job_id: str, f: Any) -> Any:
        out = hr0(self, job_id, f)
        EV.append(
            {
                "t": now(),
                "kind": "reset",
                "sid": f.session,
                "turn": TURN.get(f.session),
                "effect": str(out.effect).split(".")[-1],
            }
        )
        return out

    lt: list[Any] = []

    def ledger_turn(agent: SimAgent, run_: Any, p: Any, *rest: Any) -> Any:
        sid = agent.session.id
        TURN[sid] = p.turn
        out = lt[0](agent, run_, p, *rest)
        rec, _kn, due = out
        r = agent.session.snapshot().raw
        EV.append(
            {
                "t": now(),
                "kind": "turn",
                "sid": sid,
                "turn": p.turn,
                "retrieval": rec.retrieval,
                "refusal": rec.refusal,
                "bound": rec.bound,
                "due": due is not None,
                "reset": rec.reset,
                "after": raw_view(r),
            }
        )
        return out

    admit0 = SimAgent.admit

    def admit(self: SimAgent, consumer: Consumer, docs: Any) -> Any:
        before = raw_view(self.session.snapshot().raw) if consumer == Consumer.RETRIEVAL else None
        got = admit0(self, consumer, docs)
        if before is not None and not got.kept:
            EV.append(
                {
                    "t": now(),
                    "kind": "refused",
                    "sid": self.session.id,
                    "turn": TURN.get(self.session.id),
                    "reason": got.reason,
                    "saw": before,
                }
            )
        return got

    config = FleetConfig(seed=a.seed, only=frozenset({"001"}), sessions=8, tail=4)
    settings = LedgerSettings(redis_url="embedded://", prefix=f"lt{uuid.uuid4().hex[:8]}")
    with regime(a.regime, a.wait):
        lt.append(decay._ledger_turn)  # the regime's turn (timed in `late`)
        run_traced(a, settings, config, sleep, compact, _compact, _hard_reset, ledger_turn, admit)


def run_traced(
    a: Any,
    settings: Any,
    config: Any,
    sleep: Any,
    compact: Any,
    _compact: Any,
    _hard_reset: Any,
    ledger_turn: Any,
    admit: Any,
) -> None:
    with (
        mock.patch.object(fagent.SteppedClock, "sleep", sleep),
        mock.patch.object(wcalls.LedgerCalls, "compact", compact),
        mock.patch.object(wjobs.Jobs, "_compact", _compact),
        mock.patch.object(wjobs.Jobs, "_hard_reset", _hard_reset),
        mock.patch.object(decay, "_ledger_turn", ledger_turn),
        mock.patch.object(SimAgent, "admit", admit),
    ):  # fmt: skip
        lg = report.summarize(run(settings, config))["ledger"]
    rates = " / ".join(
        f"{v['rate']:.2f}" if v["rate"] is not None else "n/a"
        for v in lg["retrieval_admission"].values()
    )
    print(f"{a.regime} seed {a.seed}: retrieval {rates}, refusals {lg['refusals']}")
    kinds = Counter(e["kind"] for e in EV)
    print("events:", dict(kinds))
    print("pickups by effect:", dict(Counter(e["effect"] for e in EV if e["kind"] == "pickup")))
    print("commits by outcome:", dict(Counter(e["outcome"] for e in EV if e["kind"] == "commit")))
    print("resets by effect:", dict(Counter(e["effect"] for e in EV if e["kind"] == "reset")))
    print(
        "refused retrievals by (reason, kf, cd, rq):",
        dict(
            Counter(
                (e["reason"], e["saw"]["kf"], e["saw"]["cd"], e["saw"]["rq"])
                for e in EV
                if e["kind"] == "refused"
            )
        ),
    )
    sids = list(dict.fromkeys(e["sid"] for e in EV if e["kind"] == "turn"))
    # failure chains of the ledger column's sessions (the first 12): from the first failed
    # commit (kf 0 -> 1) to the turn its session next has kf = 0 (a compaction or a reset)
    chains = []
    for s in sids[:12]:
        start = None
        for e in EV:
            if e["sid"] != s:
                continue
            if e["kind"] == "commit" and e["outcome"] != "compacted" and start is None:
                start = e
            if e["kind"] == "turn" and start is not None and e["after"]["kf"] == 0:
                refused = sum(
                    1
                    for x in EV
                    if x["sid"] == s
                    and x["kind"] == "turn"
                    and start["turn"] <= x["turn"] < e["turn"]
                    and not x["retrieval"]
                )
                chains.append((start["turn"], e["turn"], refused))
                start = None
    print("failure chains (first failure turn, turn kf cleared, turns refused in it):", chains)
    if chains:
        print(
            f"mean chain {sum(b - a for a, b, _ in chains) / len(chains):.1f} turns, "
            f"mean refused {sum(r for *_, r in chains) / len(chains):.1f} turns"
        )
    per: dict[str, Counter[str]] = defaultdict(Counter)
    for e in EV:
        if e["sid"]:
            per[e["sid"]][e["kind"] + ("" if e["kind"] != "commit" else ":" + e["outcome"])] += 1
            if e["kind"] == "turn" and e["due"]:
                per[e["sid"]]["due"] += 1
    for i, s in enumerate(sids):
        print(i, short(s), dict(per[s]))
    if a.session is not None:
        s = sids[a.session]
        lines = [e for e in EV if e["sid"] == s or (e["kind"] == "pass" and False)]
        for e in lines[: a.max_lines]:
            print(line(e))


def line(e: dict[str, Any]) -> str:
    t = f"t={e['t']:8.3f} turn {e.get('turn')}"
    if e["kind"] == "turn":
        v = e["after"]
        return (
            f"{t} END  retrieval={'Y' if e['retrieval'] else '-'} "
            f"{(e['refusal'] or '') + ('/' + e['bound'] if e['bound'] else ''):28s} "
            f"due={int(e['due'])} reset={int(e['reset'])} occ={v['occ']} kf={v['kf']} "
            f"cd={v['cd']} rq={v['rq']} kn={v['kn']}"
        )
    if e["kind"] == "pickup":
        v = e["seen"]
        return (
            f"{t} PICKUP job({e['reason']}) saw occ={v.get('occ')} kf={v.get('kf')} "
            f"cd={v.get('cd')} rq={v.get('rq')} -> {e['effect']}"
        )
    if e["kind"] == "commit":
        d = e["done"]
        return (
            f"{t} COMMIT {e['outcome']}: replaced {e['n']} items, summary {e['summary']}, "
            f"dropped {d['dropped']} occ after {d['occupancy']} (HW {d['high_water_mark']}) "
            f"gain {d['gain']} failures {d['failures']} escalated {d['escalated']}"
        )
    if e["kind"] == "reset":
        return f"{t} RESET {e['effect']}"
    if e["kind"] == "refused":
        v = e["saw"]
        return (
            f"{t} REFUSED retrieval {e['reason']} saw occ={v['occ']} fr={v['fr']} "
            f"kf={v['kf']} cd={v['cd']} rq={v['rq']}"
        )
    return f"{t} {e}"


if __name__ == "__main__":
    main()
