"""The model of the rules' property test (test_properties_rules.py): what
lua/begin_turn.lua, admit.lua, admit_tool.lua, compact.lua, record_span.lua, end_turn.lua
and release.lua do to one session, restated in plain Python, with the window it runs in.
No tests here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ledger import Consumer, SessionBudget
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
from tests.support.stateful import Op, Outcome

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


@dataclass
class Rec:
    tokens: int
    turn: int
    prio: int
    seq: int


def stored(out: Outcome) -> bool:
    """Outcomes (results and refusals) are kept under their op id; errors are not."""
    return not (isinstance(out, tuple) and out[0] == "error")


def content(call: str, tokens: int) -> bytes:
    return f"result of {call}: {tokens} tokens".encode()


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
    kr: int = 0  # kf as the last deferral left it (== kf: the last one judged reached H)
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
        failed = self.kf > 0 and self.kr != self.kf  # the last compaction did not reach H
        cap = (0 if failed else W - self.out - self.HW - self.pm) if pending else None
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
        # a deferral reached H: counted, but nothing pending after it, nor retried; memory
        # is judged on the post-compaction bound after it, not refused
        landed = deferred and not ok
        self.kr = self.kf if landed else 0
        queued = self.cd == 1  # a compaction job is queued already
        self.cd = 0 if ok or landed else 1
        if ok:
            self.kn += 1
            self.kt = self.tn
        elif self.rq == 0:
            self.x["failed_compactions"] += 1
        if escalate:
            self.enqueue("hard_reset", op_id, "failed_compactions")
            self.x["escalations"] += 1
            self.rq = 1
        elif not ok and not landed and self.rq == 0 and not queued:
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
