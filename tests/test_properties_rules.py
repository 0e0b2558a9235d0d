"""Stateful property test of the seeds' rules: the ledger against a model of the scripts.

tests/test_properties.py checks admit / release / reserve / settle / void. This file
restates, in plain Python, what lua/begin_turn.lua, admit.lua, admit_tool.lua,
compact.lua, record_span.lua, end_turn.lua and release.lua do to one session, and has
hypothesis drive them (plus replays of earlier calls under their op ids) in a small
window where refusals, reclamation, spills and failed compactions happen often:

begin_turn   residual = W - S - T - out' - max(memory, F_m) - scratchpad against
             need = max(working set, working memory, F_w) after the consumers released
             each turn are rotated out; regime ok / starvation / loud (occupancy at the
             eviction threshold); reclamation scratchpad oldest first, then retrieval
             (ids recall also holds first, then oldest), then recall oldest first, applied
             only if it closes the gap; otherwise WorkingMemoryStarvation with the
             working-memory items to compact (lowest priority, then oldest), nothing
             changed but a pending compaction (and its job); else the turn advances with
             this turn's output reserve, and a compaction is due above the high-water mark.
admit        'all' / 'prefix', duplicates, floor_protected vs token_budget_exhausted, and
             while a compaction is pending memory (retrieval, recall) is capped at
             W - out - HW per call with reason compaction_pending.
admit_tool   whole; whole once memory gives way (retrieval before recall, lowest priority
             then oldest); spilled with a preview; refused (judged on the preview);
             duplicate tool-call ids.
compact      replaced items of any consumer, a working-memory summary, compacted /
             failed / did_not_fit, the failure count, one escalation (hard-reset job) at
             max_failed_compactions, a compaction job on other failures.
record_span  the amplification ratio and the fan-out guard; refused once the turn ended.
end_turn     ratio, utilization and its delta, the four classes, compaction due, roll-up.
release      tokens, count and missing ids.

After every step: every outcome equals the model's; the snapshot (free, used / items per
consumer, turn, epoch, compaction pending, failed compactions, the raw counters), the
other hash fields the rules keep (kt, te, pu, ao, telemetry counters), the exact held
items (ledger.items), the job stream and the spilled contents equal the model's; free is
never negative and the audit is clean.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ledger import AdmissionRefused, Consumer, Item, Ledger, LedgerError, Session, SessionBudget
from ledger.errors import FanoutRefused, WorkingMemoryStarvation
from ledger.models import (
    Admitted,
    Compaction,
    HeldItem,
    Released,
    SpanRecorded,
    ToolResult,
    TurnReport,
    TurnStarted,
)
from tests import servers
from tests.conftest import make_settings

# The window: small, so that refusals, reclamation and spills happen within a few steps.
W, S, T, F_W, F_M, OUT = 4_000, 300, 50, 400, 200, 200
MAX_OUT = W - S - T - F_W - F_M  # 3050: the largest output reserve a turn may ask for
CODES = ("w", "r", "m", "s")
GROUP = {"w": "w", "r": "m", "m": "m", "s": "s"}
ITEM_IDS = ("a", "b", "c", "d", "e")
CALL_IDS = ("a", "b", "t1", "t2", "t3")  # a and b collide with scratchpad admissions
SUMMARY_IDS = ("sum1", "sum2", "a")
SESSION_ID = "rules-prop/s-1"
NO_SUMMARY = "-summary-"  # the id the protocol sends when there is no summary
TOKENS = st.one_of(st.integers(1, 300), st.integers(1, 1_500))

Outcome = Any  # a result dataclass, or a tuple for a refusal or an error


@dataclass(frozen=True)
class Op:
    kind: str
    op_id: str
    args: tuple[Any, ...]


@dataclass
class Rec:
    tokens: int
    turn: int
    prio: int
    seq: int


def capture(fn: Callable[[], Any]) -> Outcome:
    try:
        return fn()
    except WorkingMemoryStarvation as e:
        return (
            "starved",
            e.reason,
            e.requested,
            e.free,
            e.residual,
            e.requirement,
            e.utilization,
            e.shortfall,
            e.compact,
        )
    except FanoutRefused as e:
        return ("fanout", e.requested, e.free, e.ratio, e.threshold)
    except AdmissionRefused as e:
        return ("refused", e.reason, e.requested, e.free)
    except LedgerError as e:
        return ("error", type(e).__name__)


def stored(out: Outcome) -> bool:
    """Outcomes (results and refusals) are kept under their op id; errors are not."""
    return not (isinstance(out, tuple) and out[0] == "error")


def content(call: str, tokens: int) -> bytes:
    return f"result of {call}: {tokens} tokens".encode()


def send(session: Session, op: Op) -> Outcome:
    a, oid = op.args, op.op_id
    if op.kind == "admit":
        c, items, partial = a
        batch = [Item(i, t, p) for i, t, p in items]
        return capture(
            lambda: session.admit(Consumer.from_code(c), batch, partial=partial, op_id=oid)
        )
    if op.kind == "release":
        c, ids = a
        return capture(lambda: session.release(Consumer.from_code(c), list(ids), op_id=oid))
    if op.kind == "begin":
        ws, out = a
        return capture(lambda: session.begin_turn(ws, out, op_id=oid))
    if op.kind == "tool":
        call, tokens = a
        return capture(
            lambda: session.admit_tool_result(call, tokens, content(call, tokens), op_id=oid)
        )
    if op.kind == "compact":
        refs, summary = a
        replaced = [(Consumer.from_code(c), i) for c, i in refs]
        item = None if summary is None else Item(summary[0], summary[1])
        return capture(lambda: session.compact(replaced, item, op_id=oid))
    if op.kind == "span":
        turn, tin, tout = a
        return capture(lambda: session.record_span(turn, "recall", tin, tout, op_id=oid))
    assert op.kind == "end"
    turn, final, trend = a
    return capture(lambda: session.end_turn(turn, final, p99_trend=trend, op_id=oid))


def pairs(refs: list[tuple[str, str]]) -> tuple[tuple[Consumer, str], ...]:
    return tuple((Consumer.from_code(c), i) for c, i in refs)


@dataclass
class Model:
    """One session as the scripts keep it (no reservations: a_<group> = items)."""

    b: SessionBudget
    ep: int = 1
    tn: int = 0
    sq: int = 0
    out: int = OUT
    items: dict[str, dict[str, Rec]] = field(default_factory=lambda: {c: {} for c in CODES})
    cd: int = 0  # compaction pending
    kf: int = 0  # consecutive failed compactions
    kn: int = 0  # compactions done
    kt: int = 0  # turn of the last one
    rq: int = 0  # hard reset requested
    ws: int = 0
    ai: int = 0
    ao: int = 0
    an: int = 0
    pu: int = -1
    te: int | None = None
    x: Counter[str] = field(default_factory=Counter)  # telemetry counters, 'x:' dropped
    jobs: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, reason, op)
    spills: dict[str, bytes] = field(default_factory=dict)
    outcomes: dict[str, tuple[Op, Outcome]] = field(default_factory=dict)

    # --- the budget as the scripts store it ---------------------------------------

    @property
    def HW(self) -> int:
        return self.b.high_water_tokens

    @property
    def EV(self) -> int:
        return self.b.eviction_tokens

    @property
    def rel(self) -> str:
        return "".join(sorted(c.code for c in self.b.release_each_turn))

    @property
    def permille(self) -> dict[str, int]:
        b = self.b
        return {
            "rup": round(b.rollup_fraction * 1000),
            "ams": round(b.amplification_saturation * 1000),
            "amf": round(b.amplification_fragmentation * 1000),
            "amp": round(b.amplification_pathological * 1000),
        }

    # --- derived numbers ------------------------------------------------------------

    def used(self, c: str) -> int:
        return sum(r.tokens for r in self.items[c].values())

    def active(self) -> dict[str, int]:
        return {
            "w": self.used("w"),
            "m": self.used("r") + self.used("m"),
            "s": self.used("s"),
        }

    def free(self, out: int | None = None, a: dict[str, int] | None = None) -> int:
        a = a or self.active()
        out = self.out if out is None else out
        return W - S - T - out - max(a["w"], F_W) - max(a["m"], F_M) - a["s"]

    def occupancy(self, a: dict[str, int] | None = None) -> int:
        a = a or self.active()
        return S + T + a["w"] + a["m"] + a["s"]

    def reason(self, requested: int) -> str:
        a = self.active()
        room = W - S - T - self.out - a["w"] - a["m"] - a["s"]
        return "floor_protected" if requested <= room else "token_budget_exhausted"

    def rotated(self) -> tuple[dict[str, dict[str, Rec]], int]:
        """The items once the consumers released each turn are gone, and their tokens."""
        items = {c: dict(self.items[c]) for c in CODES}
        gone = 0
        for c in self.rel:
            gone += sum(r.tokens for r in items[c].values())
            items[c] = {}
        return items, gone

    def residual(self, out: int | None = None) -> int:
        """begin_turn's residual working memory after rotation, before reclamation."""
        items, _ = self.rotated()
        mem = sum(r.tokens for c in "rm" for r in items[c].values())
        scratch = sum(r.tokens for r in items["s"].values())
        out = self.b.output_reserve if out is None else out
        return W - S - T - out - max(mem, F_M) - scratch

    def held(self) -> list[HeldItem]:
        out = [
            HeldItem(Consumer.from_code(c), i, r.tokens, r.turn, r.prio, r.seq)
            for c in CODES
            for i, r in self.items[c].items()
        ]
        return sorted(out, key=lambda h: h.seq)

    def add(self, c: str, item: str, tokens: int, prio: int) -> None:
        self.sq += 1
        self.items[c][item] = Rec(tokens, self.tn, prio, self.sq)

    def enqueue(self, kind: str, op_id: str, why: str) -> None:
        self.jobs.append((kind, why, op_id))

    # --- calls ----------------------------------------------------------------------

    def apply(self, op: Op) -> Outcome:
        if op.op_id in self.outcomes:
            first, out = self.outcomes[op.op_id]
            if (first.kind, first.args) == (op.kind, op.args):
                return out
            return ("error", "OperationIdReused")
        out = getattr(self, f"_{op.kind}")(op.op_id, *op.args)
        if stored(out):
            self.outcomes[op.op_id] = (op, out)
        return out

    def _admit(
        self, op_id: str, c: str, batch: tuple[tuple[str, int, int], ...], partial: bool
    ) -> Outcome:
        g = GROUP[c]
        a, floor = self.active()[g], {"w": F_W, "m": F_M, "s": 0}[g]
        fr = self.free()
        pending = g == "m" and self.cd == 1
        cap = W - self.out - self.HW if pending else None
        charged, dups, skipped, taken = 0, 0, [], []
        first_skip = None
        for i, t, p in batch:
            if i in self.items[c]:
                dups += 1
                continue
            d = max(a + charged + t, floor) - max(a + charged, floor)
            if partial and (skipped or d > fr or (cap is not None and charged + t > cap)):
                skipped.append(i)
                first_skip = t if first_skip is None else first_skip
            else:
                fr -= d
                charged += t
                taken.append((i, t, p))
        if partial:
            refused = not taken and bool(skipped)
        else:
            refused = fr < 0 or (cap is not None and charged > cap)
        if refused:
            asked = first_skip if partial else charged
            assert asked is not None
            self.x["refused"] += 1
            why = "compaction_pending" if pending else self.reason(asked)
            return ("refused", why, asked, self.free())
        for i, t, p in taken:
            self.add(c, i, t, p)
        assert fr == self.free()
        return Admitted(charged, len(taken), dups, tuple(skipped), fr, self.ep, self.tn)

    def _release(self, op_id: str, c: str, ids: tuple[str, ...]) -> Outcome:
        missing = tuple(i for i in ids if i not in self.items[c])
        gone = [self.items[c].pop(i) for i in ids if i in self.items[c]]
        return Released(
            sum(r.tokens for r in gone), len(gone), missing, self.free(), self.ep, self.tn
        )

    def _begin(self, op_id: str, ws: int, out: int | None) -> Outcome:
        out2 = self.b.output_reserve if out is None else out
        if S + T + F_W + F_M + out2 > W:
            return ("error", "ConfigurationError")
        a0 = self.active()
        items, rotated = self.rotated()
        recall_ids = set(self.items["m"])  # before rotation, as the script builds it
        act = {
            "w": sum(r.tokens for r in items["w"].values()),
            "m": sum(r.tokens for r in items["r"].values())
            + sum(r.tokens for r in items["m"].values()),
            "s": sum(r.tokens for r in items["s"].values()),
        }

        def residual() -> int:
            return W - S - T - out2 - max(act["m"], F_M) - act["s"]

        def need() -> int:
            return max(ws, act["w"], F_W)

        regime, start = "ok", residual()
        util = self.occupancy(act) * 1000 // W
        reclaimed: list[tuple[str, str]] = []
        released = 0
        if start < need():
            regime = "loud" if self.occupancy(act) >= self.EV else "starvation"
            order = [("s", i) for i in sorted(items["s"], key=lambda i: items["s"][i].seq)]
            order += [
                ("r", i)
                for i in sorted(items["r"], key=lambda i: (i not in recall_ids, items["r"][i].seq))
            ]
            order += [("m", i) for i in sorted(items["m"], key=lambda i: items["m"][i].seq)]
            for c, i in order:
                if residual() >= need():
                    break
                t = items[c].pop(i).tokens
                act[GROUP[c]] -= t
                released += t
                reclaimed.append((c, i))
            if residual() < need():
                short = need() - start
                target = max(ws, F_W)
                wm = sorted(self.items["w"].items(), key=lambda kv: (kv[1].prio, kv[1].seq))
                compact: list[str] = []
                held = act["w"]
                if residual() >= target:
                    for i, r in wm:
                        if max(held, target) <= residual():
                            break
                        compact.append(i)
                        held -= r.tokens
                self.x["starvation"] += 1
                if self.cd != 1:
                    self.enqueue("compact", op_id, regime)
                self.cd = 1
                return (
                    "starved",
                    "compaction_pending" if regime == "loud" else "starvation",
                    need(),
                    self.free(out2, a0),
                    start,
                    need(),
                    util / 1000,
                    short,
                    tuple(compact),
                )
            self.x[regime] += 1
        self.items = items
        self.tn += 1
        self.out, self.ws, self.ai, self.ao, self.an = out2, ws, 0, 0, 0
        due = self.occupancy() > self.HW or self.cd == 1
        wm_budget = F_W if F_W > 0 else W
        rollup = (
            self.tn - self.kt > self.b.rollup_turns
            or act["w"] * 1000 > self.permille["rup"] * wm_budget
        )
        if due and self.cd != 1:
            self.cd = 1
            self.enqueue("compact", op_id, "high_water_mark")
        return TurnStarted(
            regime,
            self.tn,
            residual(),
            need(),
            util / 1000,
            pairs(reclaimed),
            rotated,
            released,
            due,
            rollup,
            self.free(),
            self.ep,
        )

    def _tool(self, op_id: str, call: str, tokens: int) -> Outcome:
        fr = self.free()
        if call in self.items["s"]:
            return ToolResult("duplicate", call, 0, tokens, 0, (), fr, self.ep, self.tn)
        a_m = self.active()["m"]
        held = self.used("r") + self.used("m")
        gain = max(a_m, F_M) - max(a_m - held, F_M)
        size, outcome = tokens, "admitted"
        if tokens > fr + gain:
            size, outcome = min(tokens, self.b.spill_preview_tokens), "spilled"
        if size > fr + gain:
            self.x["refused"] += 1
            return ("refused", self.reason(size), tokens, fr)
        evicted: list[tuple[str, str]] = []
        if size > fr:
            mem = [(c, i, r) for c in "rm" for i, r in self.items[c].items()]
            mem.sort(key=lambda m: (m[0] != "r", m[2].prio, m[2].seq))
            for c, i, r in mem:
                if size <= fr:
                    break
                fr -= max(a_m - r.tokens, F_M) - max(a_m, F_M)
                a_m -= r.tokens
                del self.items[c][i]
                evicted.append((c, i))
            self.x["evicted_memory"] += len(evicted)
        if outcome == "spilled":
            self.spills[call] = content(call, tokens)
            self.x["spilled"] += 1
        self.add("s", call, size, 0)
        assert fr - size == self.free()
        preview = size if outcome == "spilled" else 0
        return ToolResult(
            outcome, call, size, tokens, preview, pairs(evicted), fr - size, self.ep, self.tn
        )

    def _compact(
        self, op_id: str, refs: tuple[tuple[str, str], ...], summary: tuple[str, int] | None
    ) -> Outcome:
        sum_id, sum_t = summary if summary is not None else (NO_SUMMARY, 0)
        if sum_id in self.items["w"] and ("w", sum_id) not in refs:
            return ("error", "SessionConflict")
        dropped = sum(self.items[c][i].tokens for c, i in refs if i in self.items[c])
        missing = tuple(f"{c}:{i}" for c, i in refs if i not in self.items[c])
        after = {c: dict(self.items[c]) for c in CODES}
        for c, i in refs:
            after[c].pop(i, None)
        a = {
            "w": sum(r.tokens for r in after["w"].values()) + sum_t,
            "m": sum(r.tokens for c in "rm" for r in after[c].values()),
            "s": sum(r.tokens for r in after["s"].values()),
        }
        fits = self.free(a=a) >= 0
        if fits:
            self.items = after
            if sum_t > 0:
                self.add("w", sum_id, sum_t, 1000)
        else:
            dropped, sum_t = 0, 0
        occ = self.occupancy()
        ok = fits and occ <= self.HW
        self.kf = 0 if ok else self.kf + 1
        escalate = not ok and self.kf >= self.b.max_failed_compactions and self.rq == 0
        self.cd = 0 if ok else 1
        if ok:
            self.kn += 1
            self.kt = self.tn
        else:
            self.x["failed_compactions"] += 1
        if escalate:
            self.enqueue("hard_reset", op_id, "failed_compactions")
            self.x["escalations"] += 1
            self.rq = 1
        elif not ok and self.rq == 0:
            self.enqueue("compact", op_id, "failed_compaction")
        outcome = "compacted" if ok else ("failed" if fits else "did_not_fit")
        return Compaction(
            ok,
            outcome,
            occ,
            self.HW,
            dropped,
            sum_t,
            missing,
            self.kf,
            escalate,
            self.free(),
            self.ep,
            self.tn,
        )

    def _span(self, op_id: str, turn: int, tin: int, tout: int) -> Outcome:
        if turn != self.tn or self.te == turn:  # not the current turn, or one ended
            return ("error", "InvalidArgument")
        prompt = max(1, self.occupancy())
        ratio = self.ai * 1000 // prompt
        amp = self.permille["amp"]
        if ratio > amp:
            self.x["fanout_refused"] += 1
            return ("fanout", tin, self.free(), ratio / 1000, amp / 1000)
        self.ai += tin
        self.ao += tout
        self.an += 1
        return SpanRecorded(self.tn, self.an, self.ai, (self.ai * 1000 // prompt) / 1000)

    def _end(self, op_id: str, turn: int, final: int, trend: int) -> Outcome:
        if turn != self.tn or self.te == turn or final > W:
            return ("error", "InvalidArgument")
        pm = self.permille
        ratio = self.ai * 1000 // final
        util = final * 1000 // W
        delta = 0 if self.pu < 0 else util - self.pu
        if ratio > pm["amp"] and delta < 0 and trend > 0:
            cls = "pathological"
        elif delta > 0 and ratio < pm["ams"]:
            cls = "saturation"
        elif ratio > pm["amf"]:
            cls = "fragmentation"
        else:
            cls = "ambiguous"
        due = self.occupancy() > self.HW or self.cd == 1
        wm_budget = F_W if F_W > 0 else W
        rollup = self.tn - self.kt > self.b.rollup_turns or self.used("w") * 1000 > (
            pm["rup"] * wm_budget
        )
        self.x[f"class:{cls}"] += 1
        if due and self.cd != 1:
            self.enqueue("compact", op_id, "high_water_mark")
        self.pu, self.cd, self.te = util, int(due), turn
        return TurnReport(
            self.tn,
            ratio / 1000,
            cls,
            util / 1000,
            delta / 1000,
            self.an,
            self.ai,
            due,
            rollup,
            self.ep,
        )


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class RulesMachine(RuleBasedStateMachine):
    """One fresh session (fresh key prefix) per example, on the backend at `url`."""

    url = "embedded://"

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger.from_settings(make_settings(self.url))
        self.session: Session | None = None
        self.model: Model | None = None
        self.history: list[Op] = []
        self.ops = 0

    def teardown(self) -> None:
        self.ledger.close()

    def new_op_id(self) -> str:
        self.ops += 1
        return f"op-{self.ops}"

    def do(self, op: Op) -> Outcome:
        assert self.session is not None and self.model is not None
        expected = self.model.apply(op)
        actual = send(self.session, op)
        assert actual == expected, f"{op}: ledger gave {actual!r}, model says {expected!r}"
        self.history.append(op)
        if isinstance(actual, ToolResult) and actual.spilled:
            assert self.ledger.read_spill(SESSION_ID, actual.item) == content(*op.args)
        return actual

    # --- rules ------------------------------------------------------------------------

    @initialize(
        marks=st.sampled_from([(0.72, 0.9), (0.5, 0.6), (0.6, 0.75)]),
        release_each_turn=st.sampled_from(
            [(), (), ("retrieval",), ("scratchpad", "retrieval"), ("recall",), ("working_memory",)]
        ),
        preview=st.sampled_from([64, 256, 700]),
        max_failed=st.sampled_from([1, 2, 3]),
        rollup=st.sampled_from([(20, 0.6), (2, 0.3)]),
        amplification=st.sampled_from([(1.5, 3.0, 8.0), (0.5, 1.0, 2.0)]),
    )
    def open_session(
        self,
        marks: tuple[float, float],
        release_each_turn: tuple[str, ...],
        preview: int,
        max_failed: int,
        rollup: tuple[int, float],
        amplification: tuple[float, float, float],
    ) -> None:
        budget = SessionBudget(
            window=W,
            system_prompt=S,
            tool_framing=T,
            working_memory_floor=F_W,
            min_memory=F_M,
            output_reserve=OUT,
            high_water_mark=marks[0],
            eviction_threshold=marks[1],
            release_each_turn=frozenset(release_each_turn),
            spill_preview_tokens=preview,
            max_failed_compactions=max_failed,
            rollup_turns=rollup[0],
            rollup_fraction=rollup[1],
            amplification_saturation=amplification[0],
            amplification_fragmentation=amplification[1],
            amplification_pathological=amplification[2],
        )
        self.session = self.ledger.open_session(SESSION_ID, budget)
        self.model = Model(budget)

    @rule(
        consumer=st.sampled_from(CODES),
        items=st.lists(
            st.tuples(st.sampled_from(ITEM_IDS), TOKENS, st.integers(0, 2)),
            min_size=1,
            max_size=3,
            unique_by=lambda t: t[0],
        ),
        partial=st.booleans(),
    )
    def admit(self, consumer: str, items: list[tuple[str, int, int]], partial: bool) -> None:
        self.do(Op("admit", self.new_op_id(), (consumer, tuple(items), partial)))

    @rule(
        consumer=st.sampled_from(CODES),
        item=st.sampled_from(ITEM_IDS),
        off=st.integers(-1, 1),
        partial=st.booleans(),
        at_cap=st.booleans(),
    )
    def fill(self, consumer: str, item: str, off: int, partial: bool, at_cap: bool) -> None:
        """Admit exactly the room left for the consumer (off 0), one token less or one
        more; for memory while a compaction is pending, optionally the per-call cap."""
        assert self.model is not None
        m = self.model
        g = GROUP[consumer]
        floor = {"w": F_W, "m": F_M, "s": 0}[g]
        tokens = m.free() + max(0, floor - m.active()[g]) + off
        if at_cap and g == "m" and m.cd == 1:
            tokens = W - m.out - m.HW + off
        items = ((item, max(1, tokens), 0),)
        self.do(Op("admit", self.new_op_id(), (consumer, items, partial)))

    @precondition(lambda self: bool(self.model.items["r"] or self.model.items["m"]))
    @rule(data=st.data(), tokens=TOKENS, prio=st.integers(0, 2))
    def mirror(self, data: st.DataObject, tokens: int, prio: int) -> None:
        """Admit to recall an id retrieval holds, or the other way round (the chunks
        begin_turn reclaims first)."""
        assert self.model is not None
        held = [(c, i) for c in "rm" for i in sorted(self.model.items[c])]
        c, i = data.draw(st.sampled_from(held), label="held")
        other = "m" if c == "r" else "r"
        self.do(Op("admit", self.new_op_id(), (other, ((i, tokens, prio),), False)))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        assert self.model is not None
        holding = [c for c in CODES if self.model.items[c]]
        c = data.draw(st.sampled_from(holding or list(CODES)), label="consumer")
        pool = st.sampled_from(ITEM_IDS + CALL_IDS + SUMMARY_IDS)
        if self.model.items[c]:
            pool = st.one_of(st.sampled_from(sorted(self.model.items[c])), pool)
        ids = data.draw(st.lists(pool, min_size=1, max_size=3, unique=True), label="ids")
        self.do(Op("release", self.new_op_id(), (c, tuple(ids))))

    @rule(
        ws=st.one_of(st.integers(0, 3_500), st.sampled_from([-1, 0, 1, 300]).map(str)),
        out=st.one_of(st.none(), st.sampled_from([0, 100, 600, 1_500, MAX_OUT])),
        config_fault=st.integers(0, 20),
    )
    def begin_turn(self, ws: int | str, out: int | None, config_fault: int) -> None:
        """A text working set is relative to the residual (the gate's boundary)."""
        assert self.model is not None
        if config_fault == 0:
            out = MAX_OUT + 1
        if isinstance(ws, str):
            ws = max(0, self.model.residual(out) + int(ws))
        self.do(Op("begin", self.new_op_id(), (ws, out)))

    @rule(
        past=st.sampled_from(["", "s", "s", "sr"]),
        off=st.sampled_from([-1, 0, 1, 1, 1, 200, 600, 3_500]),
    )
    def begin_turn_at_gate(self, past: str, off: int) -> None:
        """A working set at the gate's boundary (past ''), or just past what reclaiming
        the scratchpad ('s'), or the scratchpad and retrieval ('sr'), gives back."""
        assert self.model is not None
        items, _ = self.model.rotated()
        extra = sum(r.tokens for c in past for r in items[c].values())
        ws = max(0, self.model.residual() + extra + off)
        self.do(Op("begin", self.new_op_id(), (ws, None)))

    @precondition(lambda self: "w" not in self.model.rel and self.model.used("w") > F_W + 1)
    @rule(data=st.data(), ws=st.integers(0, F_W))
    def begin_turn_squeezed(self, data: st.DataObject, ws: int) -> None:
        """An output reserve that leaves working memory less than it holds, but at least
        the working set: refused however much is reclaimed, with items to compact."""
        assert self.model is not None
        top = data.draw(st.integers(F_W, self.model.used("w") - 1), label="residual")
        self.do(Op("begin", self.new_op_id(), (ws, W - S - T - F_M - top)))

    @rule(call=st.sampled_from(CALL_IDS), tokens=st.integers(1, 3_500))
    def tool_result(self, call: str, tokens: int) -> None:
        self.do(Op("tool", self.new_op_id(), (call, tokens)))

    @rule(call=st.sampled_from(CALL_IDS), off=st.integers(-1, 1), preview=st.booleans())
    def tool_result_at_edge(self, call: str, off: int, preview: bool) -> None:
        """A result of exactly what fits once memory gives way (off 0), one token less or
        one more; or one that must spill, its preview at that edge."""
        assert self.model is not None
        m = self.model
        a_m, held = m.active()["m"], m.used("r") + m.used("m")
        room = m.free() + max(a_m, F_M) - max(a_m - held, F_M)
        tokens = room + off
        if preview:
            tokens = max(room + 1, m.b.spill_preview_tokens + off)
        self.do(Op("tool", self.new_op_id(), (call, max(1, tokens))))

    @rule(
        data=st.data(),
        summary=st.one_of(
            st.none(), st.tuples(st.sampled_from(SUMMARY_IDS), st.integers(0, 1_500))
        ),
    )
    def compact(self, data: st.DataObject, summary: tuple[str, int] | None) -> None:
        assert self.model is not None
        held = [(c, i) for c in CODES for i in sorted(self.model.items[c])]
        pool = st.tuples(st.sampled_from(CODES), st.sampled_from(ITEM_IDS + SUMMARY_IDS))
        if held:
            pool = st.one_of(st.sampled_from(held), st.sampled_from(held), pool)
        refs = data.draw(st.lists(pool, max_size=4, unique=True), label="replaced")
        self.do(Op("compact", self.new_op_id(), (tuple(refs), summary)))

    @rule(
        off=st.sampled_from([0, 0, 0, 0, 1, -1]),
        tin=st.integers(0, 3_000),
        tout=st.integers(0, 500),
    )
    def record_span(self, off: int, tin: int, tout: int) -> None:
        assert self.model is not None
        turn = max(0, self.model.tn + off)
        self.do(Op("span", self.new_op_id(), (turn, tin, tout)))

    @rule(off=st.integers(-1, 1), tout=st.integers(0, 500))
    def record_span_at_guard(self, off: int, tout: int) -> None:
        """Bring the turn's span input to the fan-out guard's threshold exactly (off 0),
        one token under or over; the next span is judged against it."""
        assert self.model is not None
        m = self.model
        amp = m.permille["amp"]
        edge = -(-amp * max(1, m.occupancy()) // 1000)  # the least ai with ratio >= amp
        tin = max(0, edge - m.ai + off)
        self.do(Op("span", self.new_op_id(), (m.tn, tin, tout)))

    @precondition(lambda self: self.model.pu >= 0)
    @rule(delta=st.integers(-1, 1), within=st.integers(0, 3), trend=st.integers(-1, 1))
    def end_turn_near_last(self, delta: int, within: int, trend: int) -> None:
        """A final prompt whose utilization is the last one's, one per mille under or over
        (the class's delta boundary)."""
        assert self.model is not None
        m = self.model
        final = min(W, max(1, (m.pu + delta) * W // 1000 + within))
        self.do(Op("end", self.new_op_id(), (m.tn, final, trend)))

    @rule(
        off=st.sampled_from([0, 0, 0, 0, 1, -1]),
        final=st.one_of(st.integers(1, W + 200), st.integers(1, 400)),
        trend=st.integers(-1, 1),
    )
    def end_turn(self, off: int, final: int, trend: int) -> None:
        assert self.model is not None
        turn = max(0, self.model.tn + off)
        self.do(Op("end", self.new_op_id(), (turn, final, trend)))

    @precondition(lambda self: bool(self.history))
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        """Re-send an earlier call under its op id, as a retry after a lost reply would."""
        op = data.draw(st.one_of(st.just(self.history[-1]), st.sampled_from(self.history)))
        self.do(op)

    # --- invariants ---------------------------------------------------------------------

    @invariant()
    def agrees_with_model(self) -> None:
        assert self.session is not None and self.model is not None
        m = self.model
        snap = self.session.snapshot()
        assert snap.free >= 0
        assert snap.free == m.free()
        assert (snap.epoch, snap.turn, snap.output_reserve) == (m.ep, m.tn, m.out)
        assert snap.compaction_pending == (m.cd == 1)
        assert snap.failed_compactions == m.kf
        for c in CODES:
            consumer = Consumer.from_code(c)
            assert snap.used[consumer] == m.used(c), c
            assert snap.items[consumer] == len(m.items[c]), c
            assert snap.reserved[consumer] == 0, c
        a = m.active()
        want = {
            "sq": m.sq,
            "a_w": a["w"],
            "a_m": a["m"],
            "a_s": a["s"],
            "kn": m.kn,
            "rq": m.rq,
            "ws": m.ws,
            "ai": m.ai,
            "an": m.an,
            "nv": 0,
            "x:refused": m.x["refused"],
            "x:spilled": m.x["spilled"],
            "x:starvation": m.x["starvation"],
            "x:failed_compactions": m.x["failed_compactions"],
        }
        assert {k: snap.raw[k] for k in want} == want
        report = self.session.audit()
        assert report.clean, report.problems

    @invariant()
    def hash_and_jobs_agree(self) -> None:
        """The items, the other fields the rules keep, the job stream, as the model's."""
        assert self.session is not None and self.model is not None
        m = self.model
        assert self.ledger.items(SESSION_ID) == m.held()
        raw = {
            _text(k): _text(v)
            for k, v in self.ledger.client.hgetall(self.session.keys.session).items()
        }
        counters = {k[2:]: int(v) for k, v in raw.items() if k.startswith("x:")}
        assert counters == {k: v for k, v in m.x.items() if v}
        assert int(raw["kt"]) == m.kt
        assert int(raw["ao"]) == m.ao
        assert int(raw["pu"]) == m.pu
        assert raw.get("te") == (None if m.te is None else str(m.te))
        jobs = []
        for _id, fields in self.ledger.client.xrange(self.session.keys.jobs):
            f = {_text(k): _text(v) for k, v in fields.items()}
            assert (f["session"], f["epoch"]) == (SESSION_ID, str(m.ep))
            jobs.append((f["kind"], f["reason"], f["op"]))
        assert jobs == m.jobs


def check(url: str, max_examples: int) -> None:
    machine = type("Machine", (RulesMachine,), {"url": url})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=25,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


@pytest.mark.slow
@pytest.mark.embedded
def test_rules_match_model_embedded() -> None:
    check(f"embedded://{uuid.uuid4().hex}", max_examples=30)


@pytest.mark.slow
@pytest.mark.redis
def test_rules_match_model_redis(redis_server: servers.RedisProcess) -> None:
    check(redis_server.url, max_examples=15)


@pytest.mark.slow
@pytest.mark.cluster
def test_rules_match_model_cluster(redis_cluster: list[servers.RedisProcess]) -> None:
    check(f"redis+cluster://127.0.0.1:{redis_cluster[0].port}", max_examples=8)
