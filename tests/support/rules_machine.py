"""The hypothesis state machine of the rules' property test (test_properties_rules.py):
the strategies it draws calls from, each call sent to the ledger, and the rules that aim
at the edges of the rules (docs/rules.md). No tests here.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from ledger import AdmissionRefused, Consumer, Item, LedgerError, Session, SessionBudget
from ledger.errors import ContextDriftWarning, FanoutRefused, WorkingMemoryStarvation
from ledger.models import (
    ToolResult,
    TurnStarted,
)
from tests.support.rules_model import (
    CALL_IDS,
    CODES,
    F_M,
    F_W,
    GROUP,
    ITEM_IDS,
    MAX_OUT,
    OUT,
    SESSION_ID,
    SUMMARY_IDS,
    Model,
    S,
    T,
    W,
    content,
)
from tests.support.stateful import ModelMachine, Op, Outcome

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
            "kr": m.kr,
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
