"""Stateful property test of the rules (docs/rules.md): the ledger against a model of the scripts.

tests/test_properties.py checks admit / release / reserve / settle / void. This file
restates, in plain Python, what lua/begin_turn.lua, admit.lua, admit_tool.lua,
compact.lua, record_span.lua, end_turn.lua and release.lua do to one session, and has
hypothesis drive them (plus replays of earlier calls under their op ids) in a small
window where refusals, reclamation, spills and failed compactions happen often:

begin_turn   residual = W - S - T - out' - max(memory, F_rm) - scratchpad against
             need = max(working set, working memory, F_w) after the consumers released
             each turn are rotated out; regime ok / starvation / loud (occupancy at the
             eviction threshold); reclamation scratchpad oldest first, then retrieval
             (ids recall still holds first, then oldest), then recall oldest first,
             applied only if it closes the gap; otherwise WorkingMemoryStarvation with
             the working-memory items to compact (lowest priority, then oldest), nothing
             changed but a pending compaction (and its job); else the turn advances with
             this turn's output reserve, and a compaction is due above the high-water mark.
admit        'all' / 'prefix', duplicates, floor_protected vs token_budget_exhausted, and
             while a compaction is pending memory (retrieval, recall) is capped at
             W - out - HW - pm (pm: memory admitted since it became pending), none at
             all while the last compaction failed, with reason compaction_pending; a
             request within that cap but not the free room gets the free-room reason.
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
consumer, turn, epoch, output reserve, compaction pending, failed compactions, the raw
counters), the other hash fields the rules keep (kt, te, pu, ao, telemetry counters), the
exact held items (ledger.items), the job stream and the spilled contents equal the
model's; free is never negative and the audit is clean.

Each example opens a session with a drawn budget variant (marks, consumers released each
turn, spill preview, failures that escalate, roll-up and amplification thresholds) and a
drawn load of small items. Most rules aim at a rule's edges (the gate's boundary, what
reclamation can give back, the room and the per-call cap, the fan-out threshold, the
classes' delta) so that ~25 steps reach them. The test_bug_* tests at the end are
the defects this model found, kept as regression tests since their fixes.
"""

from __future__ import annotations

import dataclasses
import uuid
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from ledger import AdmissionRefused, Consumer, Item, Ledger, LedgerError, Session, SessionBudget
from ledger.errors import ContextDriftWarning, FanoutRefused, WorkingMemoryStarvation
from ledger.models import (
    Admitted,
    Classification,
    Compaction,
    CompactionOutcome,
    DriftFlag,
    HeldItem,
    Regime,
    Released,
    SpanRecorded,
    ToolResult,
    ToolResultOutcome,
    TurnReport,
    TurnStarted,
)
from tests import servers
from tests.conftest import make_settings
from tests.stateful import ModelMachine, Op, Outcome, run_machine

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
BATCH = st.lists(
    st.tuples(st.sampled_from(ITEM_IDS), TOKENS, st.integers(0, 2)),
    min_size=1,
    max_size=3,
    unique_by=lambda t: t[0],
)
WM_BATCH = st.lists(
    st.tuples(st.sampled_from(ITEM_IDS), st.integers(100, 500), st.integers(0, 2)),
    min_size=2,
    max_size=3,
    unique_by=lambda t: t[0],
)


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
    with warnings.catch_warnings():  # a prompt over the window is flagged, and modelled
        warnings.simplefilter("ignore", ContextDriftWarning)
        return capture(lambda: session.end_turn(turn, final, p99_trend=trend, op_id=oid))


def pairs(refs: list[tuple[str, str]]) -> tuple[tuple[Consumer, str], ...]:
    return tuple((Consumer.from_code(c), i) for c, i in refs)


@dataclass
class Model:
    """One session as the scripts keep it (no reservations: a_<group> = items)."""

    b: SessionBudget
    ep: int = 1  # the epoch the session was opened at
    tn: int = 0
    sq: int = 0
    out: int = OUT
    items: dict[str, dict[str, Rec]] = field(default_factory=lambda: {c: {} for c in CODES})
    cd: int = 0  # compaction pending
    kf: int = 0  # consecutive failed compactions
    pm: int = 0  # memory admitted since the pending compaction became pending
    kn: int = 0  # compactions done
    kt: int = 0  # turn of the last one
    rq: int = 0  # hard reset requested
    ws: int = 0
    ai: int = 0
    ao: int = 0
    an: int = 0
    pu: int = -1
    te: int | None = None
    df: bool = False  # the last end_turn flagged drift (here: a prompt over the window)
    open: bool = False  # a turn holds the lease (begun, not ended)
    qs: list[str] = field(default_factory=list)  # deliveries queued for the next turn
    qd: list[tuple[str, str]] = field(default_factory=list)
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

    def free(self, a: dict[str, int] | None = None) -> int:
        a = a or self.active()
        return W - S - T - self.out - max(a["w"], F_W) - max(a["m"], F_M) - a["s"]

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
            HeldItem(
                consumer=Consumer.from_code(c),
                id=i,
                tokens=r.tokens,
                turn=r.turn,
                priority=r.prio,
                seq=r.seq,
            )
            for c in CODES
            for i, r in self.items[c].items()
        ]
        return sorted(out, key=lambda h: h.seq)

    def seq_of(self, c: str, item: str) -> int:
        return self.items[c][item].seq

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
        cap = (0 if self.kf > 0 else W - self.out - self.HW - self.pm) if pending else None
        charged, dups, skipped, taken = 0, 0, [], []
        first_skip, by_cap = None, False
        for i, t, p in batch:
            if i in self.items[c]:
                dups += 1
                continue
            d = max(a + charged + t, floor) - max(a + charged, floor)
            over = cap is not None and charged + t > cap
            if partial and (skipped or d > fr or over):
                if first_skip is None:
                    first_skip, by_cap = t, over
                skipped.append(i)
            else:
                fr -= d
                charged += t
                taken.append((i, t, p))
        if partial:
            refused = not taken and bool(skipped)
        else:
            by_cap = cap is not None and charged > 0 and charged > cap
            refused = fr < 0 or by_cap
        if refused:
            asked = first_skip if partial else charged
            assert asked is not None
            self.x["refused"] += 1
            if by_cap:
                self.x["refused_pending"] += 1
            why = "compaction_pending" if by_cap else self.reason(asked)
            return ("refused", why, asked, self.free())
        if pending:
            self.pm += charged
        for i, t, p in taken:
            self.add(c, i, t, p)
        assert fr == self.free()
        return Admitted(
            charged=charged,
            admitted=len(taken),
            duplicates=dups,
            skipped=tuple(skipped),
            free=fr,
            epoch=self.ep,
            turn=self.tn,
        )

    def _release(self, op_id: str, c: str, ids: tuple[str, ...]) -> Outcome:
        missing = tuple(i for i in ids if i not in self.items[c])
        gone = [self.items[c].pop(i) for i in ids if i in self.items[c]]
        return Released(
            released=sum(r.tokens for r in gone),
            count=len(gone),
            missing=missing,
            free=self.free(),
            epoch=self.ep,
            turn=self.tn,
        )

    def _begin(self, op_id: str, ws: int, out: int | None) -> Outcome:
        out2 = self.b.output_reserve if out is None else out
        if S + T + F_W + F_M + out2 > W:
            return ("error", "ConfigurationError")
        items, rotated = self.rotated()
        recall_ids = set(items["m"])
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
                    self.pm = 0
                self.cd = 1
                return (
                    "starved",
                    "compaction_pending" if regime == "loud" else "starvation",
                    need(),
                    self.free(),
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
            self.cd, self.pm = 1, 0
            self.enqueue("compact", op_id, "high_water_mark")
        # The turn takes the lease and its deliveries: the summaries and drops of the
        # compactions committed outside a turn.
        summaries, dropped = tuple(self.qs), pairs(self.qd)
        self.qs, self.qd, self.open = [], [], True
        return TurnStarted(
            regime=Regime(regime),
            turn=self.tn,
            residual=residual(),
            need=need(),
            utilization=util / 1000,
            reclaimed=pairs(reclaimed),
            rotated=rotated,
            released=released,
            compaction_due=due,
            rollup_hint=rollup,
            free=self.free(),
            epoch=self.ep,
            summaries=summaries,
            dropped=dropped,
        )

    def _tool(self, op_id: str, call: str, tokens: int) -> Outcome:
        fr = self.free()
        if call in self.items["s"]:
            # held smaller than the result (a spill's preview): that is what may be shown
            held = self.items["s"][call].tokens
            shown = held if held < tokens else 0
            return ToolResult(
                outcome=ToolResultOutcome.DUPLICATE,
                item=call,
                charged=0,
                tokens=tokens,
                preview_tokens=shown,
                evicted=(),
                free=fr,
                epoch=self.ep,
                turn=self.tn,
            )
        a_rm = self.active()["m"]
        held = self.used("r") + self.used("m")
        gain = max(a_rm, F_M) - max(a_rm - held, F_M)
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
                fr -= max(a_rm - r.tokens, F_M) - max(a_rm, F_M)
                a_rm -= r.tokens
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
            outcome=ToolResultOutcome(outcome),
            item=call,
            charged=size,
            tokens=tokens,
            preview_tokens=preview,
            evicted=pairs(evicted),
            free=fr - size,
            epoch=self.ep,
            turn=self.tn,
        )

    def _compact(
        self, op_id: str, refs: tuple[tuple[str, str], ...], summary: tuple[str, int] | None
    ) -> Outcome:
        sum_id, sum_t = summary if summary is not None else (NO_SUMMARY, 0)
        if sum_id in self.items["w"] and ("w", sum_id) not in refs:
            return ("error", "SessionConflict")
        if self.open and refs == (("w", sum_id),) and sum_id in self.items["w"] and sum_t > 0:
            return self._recount(sum_id, sum_t)
        before = self.occupancy()
        dropped = sum(self.items[c][i].tokens for c, i in refs if i in self.items[c])
        missing = tuple((Consumer.from_code(c), i) for c, i in refs if i not in self.items[c])
        after = {c: dict(self.items[c]) for c in CODES}
        for c, i in refs:
            after[c].pop(i, None)
        a = {
            "w": sum(r.tokens for r in after["w"].values()) + sum_t,
            "m": sum(r.tokens for c in "rm" for r in after[c].values()),
            "s": sum(r.tokens for r in after["s"].values()),
        }
        fits = self.free(a=a) >= 0
        gone = [(c, i) for c, i in refs if i in self.items[c]]
        if fits:
            self.items = after
            if sum_t > 0:
                self.add("w", sum_id, sum_t, 1000)
        else:
            dropped, sum_t, gone = 0, 0, []
        if not self.open and (gone or sum_t > 0):
            # a compaction of no turn: its deliveries wait for the next turn (a summary not
            # delivered yet that it replaces leaves the queue)
            drops = [(c, i) for c, i in gone if not (c == "w" and i in self.qs)]
            self.qs = [q for q in self.qs if ("w", q) not in gone]
            if sum_t > 0:
                self.qs.append(sum_id)
            self.qd += drops
        occ = self.occupancy()
        gain = before - occ
        deferred = fits and occ <= self.HW and gain < self.b.compaction_min_gain_tokens
        ok = fits and occ <= self.HW and not deferred
        # no failure counts past an escalation, until the reset
        self.kf = 0 if ok else (self.kf + 1 if self.rq == 0 else self.kf)
        escalate = not ok and self.kf >= self.b.max_failed_compactions and self.rq == 0
        queued = self.cd == 1  # a compaction job is queued already
        self.cd = 0 if ok else 1
        if ok:
            self.kn += 1
            self.kt = self.tn
        elif self.rq == 0:
            self.x["failed_compactions"] += 1
        if escalate:
            self.enqueue("hard_reset", op_id, "failed_compactions")
            self.x["escalations"] += 1
            self.rq = 1
        elif not ok and self.rq == 0 and not queued:
            self.enqueue("compact", op_id, "failed_compaction")
        outcome = (
            "compacted" if ok else "deferred" if deferred else ("failed" if fits else "did_not_fit")
        )
        return Compaction(
            compacted=ok,
            outcome=CompactionOutcome(outcome),
            occupancy=occ,
            high_water_mark=self.HW,
            dropped=dropped,
            summary=sum_t,
            missing=missing,
            failures=self.kf,
            escalated=escalate,
            free=self.free(),
            epoch=self.ep,
            turn=self.tn,
            gain=gain,
        )

    def _recount(self, sum_id: str, sum_t: int) -> Outcome:
        """A summary replacing itself in the open turn: the agent it was delivered to
        counted it otherwise. The item takes the new count (its turn and priority kept, a
        new sequence number) if it fits; no compaction is judged or counted."""
        old = self.items["w"][sum_id]
        d = sum_t - old.tokens
        a = {
            "w": sum(r.tokens for r in self.items["w"].values()) + d,
            "m": sum(r.tokens for c in "rm" for r in self.items[c].values()),
            "s": sum(r.tokens for r in self.items["s"].values()),
        }
        ok = self.free(a=a) >= 0
        if ok:
            self.sq += 1
            self.items["w"][sum_id] = Rec(sum_t, old.turn, old.prio, self.sq)
        return Compaction(
            compacted=False,
            outcome=CompactionOutcome.RECOUNTED if ok else CompactionOutcome.DID_NOT_FIT,
            occupancy=self.occupancy(),
            high_water_mark=self.HW,
            dropped=old.tokens if ok else 0,
            summary=sum_t if ok else 0,
            missing=(),
            failures=self.kf,
            escalated=False,
            free=self.free(),
            epoch=self.ep,
            turn=self.tn,
            gain=-d if ok else 0,
        )

    def _span(self, op_id: str, turn: int, tin: int, tout: int) -> Outcome:
        if turn != self.tn or self.te == turn:  # not the open turn, or one ended
            return ("error", "TurnLost")
        prompt = max(1, self.occupancy())
        ratio = self.ai * 1000 // prompt
        amp = self.permille["amp"]
        if ratio > amp:
            self.x["fanout_refused"] += 1
            return ("fanout", tin, self.free(), ratio / 1000, amp / 1000)
        self.ai += tin
        self.ao += tout
        self.an += 1
        return SpanRecorded(
            turn=self.tn,
            spans=self.an,
            span_input=self.ai,
            ratio=(self.ai * 1000 // prompt) / 1000,
        )

    def _end(self, op_id: str, turn: int, final: int, trend: int) -> Outcome:
        if turn != self.tn or self.te == turn:
            return ("error", "TurnLost")
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
            self.pm = 0
        occ = self.occupancy()
        flag = "over_window" if final > W else "none"  # the budget judges no drift
        if flag != "none":
            self.x["drift"] += 1
        self.pu, self.cd, self.te, self.df = util, int(due), turn, flag != "none"
        self.open = False
        return TurnReport(
            turn=self.tn,
            ratio=ratio / 1000,
            classification=Classification(cls),
            utilization=util / 1000,
            utilization_delta=delta / 1000,
            spans=self.an,
            span_input=self.ai,
            compaction_due=due,
            rollup_hint=rollup,
            epoch=self.ep,
            occupancy=occ,
            drift=final - occ,
            tolerance=None,
            flag=DriftFlag(flag),
        )


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class RulesMachine(ModelMachine):
    """One fresh session per example, on the backend at `url`, beside the Model."""

    def send(self, op: Op) -> Outcome:
        assert self.session is not None
        return send(self.session, op)

    def same(self, actual: Outcome, expected: Outcome) -> bool:
        if isinstance(actual, TurnStarted):  # the lease's end is Redis's clock's
            actual = dataclasses.replace(actual, lease_until_ms=0)
        return bool(actual == expected)

    def seen(self, op: Op, actual: Outcome) -> None:
        if isinstance(actual, ToolResult) and actual.spilled:
            assert self.ledger.read_spill(SESSION_ID, actual.item) == content(*op.args)

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
        min_gain=st.sampled_from([0.0, 0.0, 0.05, 0.3]),
        load=st.lists(st.sampled_from(CODES), max_size=16).flatmap(
            lambda cs: st.tuples(
                *(st.tuples(st.just(c), st.sampled_from(ITEM_IDS), st.integers(1, 400)) for c in cs)
            )
        ),
    )
    def open_session(
        self,
        marks: tuple[float, float],
        release_each_turn: tuple[str, ...],
        preview: int,
        max_failed: int,
        rollup: tuple[int, float],
        amplification: tuple[float, float, float],
        min_gain: float,
        load: tuple[tuple[str, str, int], ...],
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
            compaction_min_gain=min_gain,
        )
        self.session = self.ledger.open_session(SESSION_ID, budget)
        self.model = Model(budget, ep=self.session.epoch)
        # A loaded window from the first step on: small items, interleaved across the
        # consumers, priorities out of step with age, retrieval and recall sharing ids.
        for n, (c, item, tokens) in enumerate(load):
            self.do(Op("admit", self.new_op_id(), (c, ((item, tokens, (n * 2) % 3),), False)))

    @rule(
        data=st.data(),
        consumer=st.sampled_from(CODES),
        how=st.sampled_from(["batch", "batch", "edge", "edge", "held"]),
        partial=st.booleans(),
    )
    def admit(self, data: st.DataObject, consumer: str, how: str, partial: bool) -> None:
        """batch: any batch of items; edge: one item at an edge, off by -1, 0 or +1 token
        (room: what the consumer can take, free plus its group's unused floor; window:
        the unclaimed room, floors ignored, floor_protected up to it and
        token_budget_exhausted past it; cap: for memory while a compaction is pending,
        the per-call cap W - out - HW); held: items the consumer holds (duplicates,
        charged nothing), maybe with a new one after them."""
        assert self.model is not None
        m = self.model
        if how == "held" and m.items[consumer]:
            ids = st.sampled_from(sorted(m.items[consumer]))
            held = data.draw(st.lists(ids, min_size=1, max_size=3, unique=True), label="held")
            items = [(i, data.draw(TOKENS, label="tokens"), 0) for i in held]
            fresh = [i for i in ITEM_IDS if i not in m.items[consumer]]
            if fresh and data.draw(st.booleans(), label="new"):
                items.append((fresh[0], data.draw(TOKENS, label="tokens"), 1))
        elif how == "edge":
            a = m.active()
            unused = {"w": max(0, F_W - a["w"]), "m": max(0, F_M - a["m"]), "s": 0}
            edge = data.draw(st.sampled_from(["room", "room", "window", "cap"]), label="edge")
            # window: a consumer of another group than one whose floor is unused, so that
            # floor_protected can be the reason
            other = [c for c in CODES if any(unused[g] for g in "wms" if g != GROUP[c])]
            if edge == "window" and other:
                consumer = data.draw(st.sampled_from(other), label="consumer")
            g = GROUP[consumer]
            tokens = m.free() + unused[g]
            if edge == "window":
                tokens = W - S - T - m.out - a["w"] - a["m"] - a["s"]
            elif edge == "cap" and g == "m" and m.cd == 1:
                tokens = W - m.out - m.HW
            tokens += data.draw(st.integers(-1, 1), label="off")
            items = [(data.draw(st.sampled_from(ITEM_IDS), label="id"), max(1, tokens), 0)]
        else:
            items = data.draw(BATCH, label="batch")
        self.do(Op("admit", self.new_op_id(), (consumer, tuple(items), partial)))

    @rule(
        chunks=st.lists(
            st.tuples(st.sampled_from(ITEM_IDS), st.integers(1, 400), st.integers(0, 2)),
            min_size=1,
            max_size=3,
            unique_by=lambda t: t[0],
        ),
        tokens=st.integers(1, 400),
    )
    def twins(self, chunks: list[tuple[str, int, int]], tokens: int) -> None:
        """Retrieval chunks, then recall of the same content as the newest one held (the
        chunks begin_turn reclaims first are those recall also holds)."""
        assert self.model is not None
        m = self.model
        self.do(Op("admit", self.new_op_id(), ("r", tuple(chunks), True)))
        if m.items["r"]:
            newest = max(m.items["r"], key=lambda i: m.seq_of("r", i))
            self.do(Op("admit", self.new_op_id(), ("m", ((newest, tokens, 0),), False)))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """Mostly ids the consumer holds, mixed with ids it does not."""
        assert self.model is not None
        holding = [c for c in CODES if self.model.items[c]]
        c = data.draw(st.sampled_from(holding or list(CODES)), label="consumer")
        pool = st.sampled_from(ITEM_IDS + CALL_IDS + SUMMARY_IDS)
        if self.model.items[c]:
            pool = st.one_of(st.sampled_from(sorted(self.model.items[c])), pool)
        ids = data.draw(st.lists(pool, min_size=1, max_size=3, unique=True), label="ids")
        self.do(Op("release", self.new_op_id(), (c, tuple(ids))))

    def reclaimable(self) -> tuple[int, int]:
        """What begin_turn's reclamation can give back: (scratchpad, scratchpad plus memory
        above its floor), once the consumers released each turn are gone."""
        assert self.model is not None
        items, _ = self.model.rotated()
        mem = sum(r.tokens for c in "rm" for r in items[c].values())
        scratch = sum(r.tokens for r in items["s"].values())
        return scratch, scratch + max(0, mem - F_M)

    @rule(off=st.sampled_from([-1, 0, 1, 1, 600, 3_500]))
    def begin_turn(self, off: int) -> None:
        """A working set at the gate's boundary (residual -1, 0, +1), or far past it."""
        assert self.model is not None
        ws = max(0, self.model.residual() + off)
        self.do(Op("begin", self.new_op_id(), (ws, None)))

    @precondition(lambda self: self.reclaimable()[1] > 0)
    @rule(data=st.data(), how=st.sampled_from(["some", "memory", "memory", "all"]))
    def begin_turn_reclaiming(self, data: st.DataObject, how: str) -> None:
        """A working set that reclamation covers: some of what it can give back, all of the
        scratchpad and some of memory (where memory is above its floor), or all it can
        give back (and one token more)."""
        assert self.model is not None
        scratch, can = self.reclaimable()
        if how == "memory" and can == scratch:
            how = "some"
        lo, hi = {"some": (1, can), "memory": (scratch + 1, can), "all": (can, can + 1)}[how]
        ws = self.model.residual() + data.draw(st.integers(lo, max(lo, hi)), label="past")
        self.do(Op("begin", self.new_op_id(), (ws, None)))

    @rule(data=st.data(), how=st.sampled_from(["any", "squeeze", "squeeze", "fault"]))
    def begin_turn_with_reserve(self, data: st.DataObject, how: str) -> None:
        """This turn's own output reserve. any: any reserve, mostly with a working set
        that fits (the reserve then holds for the turn); squeeze: a reserve that leaves
        working memory less than it holds (but at least the working set), so the turn is
        refused with items to compact (working memory is given a few items first if it
        holds too little for that); fault: one too large for the window."""
        assert self.model is not None
        m = self.model
        out: int | None = MAX_OUT + 1
        if how == "squeeze" and m.used("w") <= F_W + 1:
            items = data.draw(WM_BATCH, label="working memory")
            self.do(Op("admit", self.new_op_id(), ("w", tuple(items), True)))
        if how == "any" or (how == "squeeze" and ("w" in m.rel or m.used("w") <= F_W + 1)):
            out = data.draw(st.sampled_from([None, 0, 100, 600, 1_500, MAX_OUT]), label="out")
            fits = st.integers(0, max(0, m.residual(out)))  # mostly a turn that starts
            ws = data.draw(st.one_of(fits, fits, st.integers(0, 3_500)), label="ws")
        elif how == "squeeze":
            ws = data.draw(st.integers(0, F_W), label="ws")
            top = data.draw(st.integers(F_W, m.used("w") - 1), label="residual")
            out = W - S - T - F_M - top
        else:
            ws = data.draw(st.integers(0, 3_500), label="ws")
        self.do(Op("begin", self.new_op_id(), (ws, out)))

    @rule(
        call=st.sampled_from(CALL_IDS),
        tokens=st.one_of(
            st.integers(1, 3_500), st.sampled_from(["-1", "0", "+1", "preview", "evict"])
        ),
        data=st.data(),
    )
    def tool_result(self, call: str, tokens: int | str, data: st.DataObject) -> None:
        """A text size is exactly what fits once memory gives way (0), one token less or
        one more; ('evict') one that needs part of memory to give way; or ('preview') one
        that must spill."""
        assert self.model is not None
        if isinstance(tokens, str):
            m = self.model
            a_rm, held = m.active()["m"], m.used("r") + m.used("m")
            gain = max(a_rm, F_M) - max(a_rm - held, F_M)
            room = m.free() + gain
            if tokens == "preview":
                tokens = max(room + 1, m.b.spill_preview_tokens)
            elif tokens == "evict":
                tokens = m.free() + data.draw(st.integers(1, max(1, gain)), label="past free")
            else:
                tokens = room + int(tokens)
        self.do(Op("tool", self.new_op_id(), (call, max(1, tokens))))

    @rule(
        data=st.data(),
        summary=st.one_of(
            st.none(),
            st.tuples(st.sampled_from(SUMMARY_IDS), st.integers(0, 1_500)),
            st.tuples(st.sampled_from(SUMMARY_IDS), st.sampled_from(["-1", "0", "+1"])),
        ),
    )
    def compact(self, data: st.DataObject, summary: tuple[str, int | str] | None) -> None:
        """Replace held items of any consumer (and ids not held) by a summary; a text
        summary size lands the occupancy at the high-water mark (0), one token under or
        over (the hard post-condition's boundary)."""
        assert self.model is not None
        m = self.model
        held = [(c, i) for c in CODES for i in sorted(m.items[c])]
        pool = st.tuples(st.sampled_from(CODES), st.sampled_from(ITEM_IDS + SUMMARY_IDS))
        if held:
            pool = st.one_of(st.sampled_from(held), st.sampled_from(held), pool)
        refs = data.draw(st.lists(pool, max_size=4, unique=True), label="replaced")
        if summary is not None and isinstance(summary[1], str):
            gone = sum(m.items[c][i].tokens for c, i in refs if i in m.items[c])
            summary = (summary[0], max(0, m.HW - (m.occupancy() - gone) + int(summary[1])))
        self.do(Op("compact", self.new_op_id(), (tuple(refs), summary)))

    @rule(
        off=st.sampled_from([0, 0, 0, 0, 1, -1]),
        tin=st.one_of(st.integers(0, 3_000), st.sampled_from(["-1", "0", "+1"])),
        tout=st.integers(0, 500),
    )
    def record_span(self, off: int, tin: int | str, tout: int) -> None:
        """A text input size brings the turn's span input to the fan-out guard's
        threshold exactly (0), one token under or over, and a second span is judged
        against it."""
        assert self.model is not None
        m = self.model
        turn = max(0, m.tn + off)
        if isinstance(tin, str):
            amp = m.permille["amp"]
            edge = -(-amp * max(1, m.occupancy()) // 1000)  # the least ai with ratio >= amp
            self.do(Op("span", self.new_op_id(), (turn, max(0, edge - m.ai + int(tin)), 0)))
            tin = 1
        self.do(Op("span", self.new_op_id(), (turn, tin, tout)))

    @rule(
        off=st.sampled_from([0, 0, 0, 0, 1, -1]),
        final=st.one_of(
            st.integers(1, W + 200), st.integers(1, 400), st.sampled_from(["last", "hot", "hot"])
        ),
        delta=st.integers(-1, 1),
        within=st.integers(0, W // 1000 - 1),
        trend=st.integers(-1, 1),
    )
    def end_turn(self, off: int, final: int | str, delta: int, within: int, trend: int) -> None:
        """last: a final prompt whose utilization is the last end_turn's plus delta per
        mille (the classes' delta boundary); hot: the same, after a span whose input
        takes the turn's ratio past the pathological threshold at that prompt. A turn
        that has ended is followed by the next one first (off 0)."""
        assert self.model is not None
        m = self.model
        if m.te == m.tn and off == 0:
            self.do(Op("begin", self.new_op_id(), (0, None)))
        if isinstance(final, str):
            mode, final = final, max(1, (max(m.pu, 0) + delta) * W // 1000 + within)
            tin = -(-final * (m.permille["amp"] + 1) // 1000) - m.ai
            if mode == "hot" and tin > 0 and m.te != m.tn:
                self.do(Op("span", self.new_op_id(), (m.tn, tin, 0)))
        final = min(W + 1, max(1, final))
        self.do(Op("end", self.new_op_id(), (max(0, m.tn + off), final, trend)))

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
            "a_rm": a["m"],
            "a_s": a["s"],
            "kn": m.kn,
            "rq": m.rq,
            "ws": m.ws,
            "ai": m.ai,
            "an": m.an,
            "nv": 0,
            "pm": m.pm,
            "x:refused": m.x["refused"],
            "x:spilled": m.x["spilled"],
            "x:starvation": m.x["starvation"],
            "x:failed_compactions": m.x["failed_compactions"],
        }
        assert {k: snap.raw[k] for k in want} == want
        report = self.session.audit()
        # Clean, but for a flagged drift (a prompt over the window) until the next end_turn.
        assert report.clean == (not self.model.df), report.problems
        assert all(p.startswith("drift: ") for p in report.problems), report.problems

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
        for call, data in m.spills.items():
            assert self.ledger.read_spill(SESSION_ID, call) == data


def check(url: str, max_examples: int) -> None:
    run_machine(RulesMachine, url, max_examples, steps=25)


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


# --- defects the model found, fixed: each stays as a regression test ---------------------


def _session(sid: str, **kw: Any) -> tuple[Ledger, Session]:
    ledger = Ledger.from_settings(make_settings(f"embedded://{uuid.uuid4().hex}"))
    budget = SessionBudget(
        window=W,
        system_prompt=S,
        tool_framing=T,
        working_memory_floor=F_W,
        min_memory=F_M,
        output_reserve=OUT,
        **kw,
    )
    return ledger, ledger.open_session(sid, budget)


@pytest.mark.embedded
def test_bug_starvation_refusal_reports_the_sessions_free() -> None:
    """begin_turn's refusal reports free computed with the refused turn's own output
    reserve (-2600 here) instead of the session's free (250)."""
    ledger, s = _session("bug/free")
    with ledger:
        s.admit(Consumer.WORKING_MEMORY, [Item("t1", 1_000)])
        s.admit(Consumer.SCRATCHPAD, [Item("x", 2_000)])
        free = s.snapshot().free  # 250
        with pytest.raises(WorkingMemoryStarvation) as caught:
            s.begin_turn(400, MAX_OUT)  # refused: nothing changes
        assert s.snapshot().free == free
        assert caught.value.free == free


@pytest.mark.embedded
def test_bug_duplicates_are_not_refused_while_a_compaction_is_pending() -> None:
    """An 'all' batch of duplicates (charged 0) is refused as compaction_pending when
    the per-call cap W - out - HW is negative; 'prefix' admits the same batch."""
    ledger, s = _session("bug/dups")
    with ledger:
        s.admit(Consumer.RETRIEVAL, [Item("a", 100)])
        s.begin_turn(0, 1_500)  # this turn's output reserve 1500: cap 4000 - 1500 - 2880 < 0
        with pytest.raises(WorkingMemoryStarvation):
            s.begin_turn(3_500, 1_500)  # a compaction is now pending
        assert s.snapshot().compaction_pending
        prefix = s.admit(Consumer.RETRIEVAL, [Item("a", 100)], partial=True)
        assert (prefix.charged, prefix.duplicates) == (0, 1)
        whole = s.admit(Consumer.RETRIEVAL, [Item("a", 100)])
        assert (whole.charged, whole.duplicates) == (0, 1)
        with pytest.raises(AdmissionRefused) as caught:  # anything new is still capped
            s.admit(Consumer.RETRIEVAL, [Item("a", 100), Item("b", 1)])
        assert (caught.value.reason, caught.value.requested) == ("compaction_pending", 1)


@pytest.mark.embedded
def test_bug_recall_released_each_turn_does_not_make_retrieval_redundant() -> None:
    """The ids recall holds are taken before the rotation, so a retrieval chunk whose
    recall copy is released this turn is still reclaimed first, before older chunks."""
    ledger, s = _session("bug/rotation", release_each_turn=frozenset({Consumer.RECALL}))
    with ledger:
        s.admit(Consumer.RETRIEVAL, [Item("a", 300), Item("b", 300)])  # a is the older
        s.admit(Consumer.RECALL, [Item("b", 300)])  # released at the next begin_turn
        # After the rotation: residual 4000 - 350 - 200 - 600 = 2850; one chunk must go.
        started = s.begin_turn(2_851)
        assert started.rotated == 300
        assert started.reclaimed == ((Consumer.RETRIEVAL, "a"),)  # the oldest
