"""The checker: a recorded history and the final state, against a model of the rules.

The history is every call of every client (``client.py``): op, op id, arguments, when it
was sent and when it returned, and what it returned, or that it failed, or that its
outcome is unknown (no reply: a timeout, an outage, a killed process). The model knows
the rules, not how calls are laid out: it reads what each call returned.

A turn's effects stand or go together: a turn whose ``end_turn`` returned is committed,
one whose ``end_turn`` failed, or that was never ended (its process died), is rolled back
(its admissions go, its releases and settles are undone), and one whose ``end_turn`` has
an unknown outcome may be either. From that, each anomaly below is a broken rule:

- ``lost``: an item a committed turn admitted (or settled), never released, is not held
  at the end (an acknowledged effect lost), or is held with other tokens.
- ``phantom``: an item held at the end that no call admitted, or only calls that were
  refused, or only a rolled-back turn.
- ``twice``: one op id with two different replies (a call sent again was applied
  again instead of answered from its stored outcome).
- ``overallocated``: a reply with negative free room, or a session whose audit is not
  clean or whose free room is negative at the end.
- ``two_owners``: two begin_turn calls given the same turn; or a call of a turn that
  took effect (returned) although it was sent after another owner's later turn had
  begun (a turn has one owner at a time: the later begin rolled it back).
- ``summary``: a worker's summary, or an item it replaced, delivered to two committed
  turns, or only to turns that were rolled back (it must come again to a later turn,
  and so must the items it replaced); ``lost`` also names a delivered summary not held
  at the end (nor named among the items a later delivery replaced). What a summary
  replaced is known from the turn it was delivered to; the run ends with turns of its
  own on each session, until nothing is pending or queued, so that every summary made is
  delivered. A summary whose every delivery was (or may have been) rolled back is queued
  again; a compaction that replaces it while it waits takes it out of the queue, and no
  later begin names it, as a summary or as a replaced item (docs/compaction.md: a
  summary not delivered yet that a later compaction replaces leaves the queue; what it
  replaced stays queued, and is delivered with the later summary). No reply shows that
  compaction: such a summary is no anomaly when it is not held at the end and one of the
  worker's compactions planned to replace it (the worker's plans are records of op
  ``compact``, see ``compactor.py``). Likewise a compaction's deliveries (its summary,
  what it replaced) may go to a begin of unknown outcome, still unanswered when the
  compaction was planned, whose turn its owner then ended by beginning again: what it
  replaced may be gone, and its summary held, with no reply naming them.
- ``reservation``: a reservation ended twice (settled and voided, or settled twice
  under different op ids), or still open at the end (after its lease and a sweep).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TURN_OPS = ("admit", "release", "reserve", "settle", "void", "end_turn")


@dataclass
class Rec:
    p: str
    n: int
    op: str
    sid: str
    id: str
    a: dict[str, Any]
    t0: float
    t1: float | None = None
    ok: bool | None = None  # None: unknown
    r: dict[str, Any] | None = None
    e: str | None = None


@dataclass
class Final:
    """A session at the end of the run: items held (id -> tokens), open reservations,
    whether its audit is clean, its free room."""

    items: dict[str, int]
    open_reservations: int
    clean: bool
    free: int
    epoch: int = 0


@dataclass
class Report:
    calls: int = 0
    ok: int = 0
    failed: int = 0
    unknown: int = 0
    duplicates: int = 0
    turns: int = 0
    committed: int = 0
    rolled_back: int = 0
    resets: int = 0  # sessions reset (their epoch advanced) during the run
    summaries: int = 0  # summaries delivered (to a turn that was committed)
    faults: dict[str, int] = field(default_factory=dict)
    anomalies: list[tuple[str, str]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds of each phase

    def kinds(self) -> set[str]:
        return {k for k, _ in self.anomalies}

    def summary(self) -> str:
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"
        head = (
            f"{self.calls} calls ({self.ok} ok, {self.failed} refused, {self.unknown} unknown, "
            f"{self.duplicates} sent twice), {self.turns} turns ({self.committed} committed, "
            f"{self.rolled_back} rolled back), {self.summaries} summaries delivered, "
            f"{self.resets} sessions reset; "
            f"faults: {faults}; "
            f"{len(self.anomalies)} anomalies"
        )
        shown = [f"  {k}: {what}" for k, what in self.anomalies[:20]]
        return "\n".join([head, *shown])


def load(directory: Path) -> list[Rec]:
    """Every call of every client's file, in no particular order."""
    recs: dict[tuple[str, int], Rec] = {}
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by SIGKILL
            key = (d["p"], d["n"])
            if d["k"] == "inv":
                recs[key] = Rec(d["p"], d["n"], d["op"], d["sid"], d["id"], d["a"], d["t"])
            elif key in recs:
                rec = recs[key]
                rec.t1, rec.ok, rec.r, rec.e = d["t"], d["ok"], d.get("r"), d.get("e")
    return list(recs.values())


def check(history: list[Rec], final: dict[str, Final]) -> Report:
    # the worker's compaction plans (compactor.py): no calls of the clients, outcome unknown
    plans = [r for r in history if r.op == "compact"]
    history = [r for r in history if r.op != "compact"]
    rep = Report(calls=len(history))
    bad = rep.anomalies.append
    for r in history:
        if r.ok is True:
            rep.ok += 1
        elif r.ok is False:
            rep.failed += 1
        else:
            rep.unknown += 1

    # twice: one op id, one reply
    by_id: dict[str, list[Rec]] = defaultdict(list)
    for r in history:
        by_id[r.id].append(r)
    for op_id, recs in by_id.items():
        rep.duplicates += len(recs) > 1
        replies = {json.dumps(r.r, sort_keys=True) for r in recs if r.ok is True}
        if len(replies) > 1:
            bad(("twice", f"{recs[0].op} {op_id} ({recs[0].sid}) answered {sorted(replies)}"))

    # overallocated: every reply's free room
    for r in history:
        if r.ok and isinstance(r.r, dict) and isinstance(r.r.get("free"), int) and r.r["free"] < 0:
            bad(("overallocated", f"{r.op} {r.id} ({r.sid}) left free={r.r['free']}"))
    for sid, f in final.items():
        if not f.clean or f.free < 0:
            bad(("overallocated", f"{sid} at the end: audit clean={f.clean}, free={f.free}"))

    # turns: who began which, and whether each was committed
    begins: dict[tuple[str, int], list[Rec]] = defaultdict(list)  # (sid, turn) -> begins
    for r in history:
        if r.op == "begin_turn" and r.ok and r.r:
            begins[(r.sid, int(r.r["turn"]))].append(r)
    state: dict[tuple[str, int], str] = {}  # committed | rolled_back | unknown
    ends: dict[tuple[str, int], list[Rec]] = defaultdict(list)
    for r in history:
        if r.op == "end_turn":
            ends[(r.sid, int(r.a["turn"]))].append(r)
    again: dict[str, list[Rec]] = defaultdict(list)  # sid -> begins sent (any outcome)
    hidden: dict[str, list[float]] = defaultdict(list)  # sid -> begins of unknown outcome
    unresolved: dict[str, list[float | None]] = defaultdict(list)  # -> when they gave up
    for r in history:
        if r.op == "begin_turn":
            again[r.sid].append(r)
            if r.ok is None:
                hidden[r.sid].append(r.t0)
                unresolved[r.sid].append(r.t1)
    for key, bs in begins.items():
        if len({b.id for b in bs}) > 1:
            owners = sorted({b.p for b in bs})
            bad(("two_owners", f"turn {key[1]} of {key[0]} begun by {len(bs)} calls: {owners}"))
        es = ends.get(key, [])
        first = min(b.t0 for b in bs)
        if any(e.ok is True for e in es):
            state[key] = "committed"
        elif any(e.ok is None for e in es) or (
            not es and any(o.p == bs[0].p and o.t0 > first for o in again[key[0]])
        ):
            # (never ended, but its owner began again on the session: a begin ends the
            # owner's own open turn as it stands, if no one rolled it back before)
            state[key] = "unknown"
        else:
            state[key] = "rolled_back"
    rep.turns = len(state)
    rep.committed = sum(v == "committed" for v in state.values())
    rep.rolled_back = sum(v == "rolled_back" for v in state.values())
    # a call of turn n that returned although another owner's later turn had begun
    # (returned) before it was sent
    later: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
    for (sid, turn), bs in begins.items():
        for b in bs:
            if b.t1 is not None:
                later[sid].append((b.t1, turn, b.p))
    sent = {op_id: min(r.t0 for r in recs) for op_id, recs in by_id.items()}
    for r in history:
        if r.op in TURN_OPS and r.ok is True:
            turn = int(r.a["turn"])
            for t1, m, owner in later[r.sid]:
                # (a call sent again gets its stored outcome: its first sending counts)
                if m > turn and owner != r.p and t1 < sent[r.id]:
                    bad(("two_owners", f"{r.op} {r.id} of turn {turn} ({r.p}, {r.sid}) took "
                         f"effect after {owner} began turn {m}"))  # fmt: skip
                    break

    def status(r: Rec) -> str:
        """'yes' (took effect and stands), 'no' (did not, or was undone), 'maybe'."""
        turn_state = state.get((r.sid, int(r.a["turn"])), "rolled_back")
        if r.ok is False or turn_state == "rolled_back":
            return "no"
        if r.ok is None or turn_state == "unknown":
            return "maybe"
        return "yes"

    # items: what must be held at the end, and what must not
    adds: dict[tuple[str, str], list[tuple[Rec, int]]] = defaultdict(list)
    removes: dict[tuple[str, str], list[Rec]] = defaultdict(list)
    enders: dict[tuple[str, str], list[Rec]] = defaultdict(list)
    for r in history:
        if r.op == "admit":
            adds[(r.sid, r.a["item"])].append((r, int(r.a["tokens"])))
        elif r.op == "settle":
            adds[(r.sid, r.a["rid"])].append((r, int(r.a["actual"])))
            enders[(r.sid, r.a["rid"])].append(r)
        elif r.op == "void":
            enders[(r.sid, r.a["rid"])].append(r)
        elif r.op == "release":
            removes[(r.sid, r.a["item"])].append(r)
    # compactions: a summary replaced items between turns; the begin_turn it was
    # delivered to names it and what it replaced (a rolled-back turn's deliveries come
    # again to a later turn; the compaction itself stands)
    delivered: dict[tuple[str, str], list[str]] = defaultdict(list)  # -> turn states
    replaced: dict[tuple[str, str], list[str]] = defaultdict(list)  # item -> turn states
    delivered_at: dict[tuple[str, str], list[float]] = defaultdict(list)
    delivered_ep: dict[tuple[str, str], int] = {}  # the epoch a summary was delivered in
    replaced_at: dict[tuple[str, str], list[float]] = defaultdict(list)
    for (sid, turn), bs in begins.items():
        for b in {b.id: b for b in bs}.values():  # (a begin sent twice: one delivery)
            assert b.r is not None
            for _, item in b.r.get("dropped") or []:
                replaced[(sid, item)].append(state[(sid, turn)])
                replaced_at[(sid, item)].append(b.t0)
                if isinstance(b.r.get("epoch"), int):
                    delivered_ep[(sid, item)] = b.r["epoch"]
            for summary in b.r.get("summaries") or []:
                delivered[(sid, summary)].append(state[(sid, turn)])
                delivered_at[(sid, summary)].append(b.t0)
                if isinstance(b.r.get("epoch"), int):
                    delivered_ep[(sid, summary)] = b.r["epoch"]
    compacted = set(replaced)
    # summaries a compaction of the worker's planned to replace (it may have committed)
    planned = {(r.sid, i) for r in plans for c, i in r.a.get("replaced") or [] if c == "w"}
    plan_at: dict[tuple[str, str], float] = {}  # what a plan replaced or made -> first plan
    for r in sorted(plans, key=lambda r: r.t0):
        for _, i in [*(r.a.get("replaced") or []), ["w", r.a.get("summary")]]:
            plan_at.setdefault((r.sid, i), r.t0)

    def taken_unseen(sid: str, item: str) -> bool:
        """Whether a compaction of the worker's planned to replace ``item`` (or made it, a
        summary) and a begin of unknown outcome, still unanswered when the plan was made,
        may have been handed its delivery: no reply shows what that begin was given (its
        owner may then end its turn by beginning again)."""
        at = plan_at.get((sid, item))
        return at is not None and any(t1 is None or t1 > at for t1 in unresolved[sid])

    seen: dict[str, set[int]] = defaultdict(set)
    for r in sorted(history, key=lambda r: r.t0):
        if r.ok and r.r and isinstance(r.r.get("epoch"), int) and r.p != "last":
            seen[r.sid].add(r.r["epoch"])
    rep.resets = sum(
        len(seen[sid] | ({f.epoch} if f.epoch else set())) - 1 for sid, f in final.items()
    )

    def unseen(sid: str, key: tuple[str, str], table: dict[tuple[str, str], list[float]]) -> bool:
        """Whether a begin of unknown outcome was sent after the first delivery: its turn
        (which no reply shows) may have been given it, and committed."""
        return any(t > min(table[key]) for t in hidden[sid])

    def reset(sid: str, name: str) -> bool:
        """Whether the session was reset since ``name`` was delivered (which drops what
        was queued for delivery with everything else)."""
        return sid in final and delivered_ep.get((sid, name), final[sid].epoch) < final[sid].epoch

    for (sid, item), states in replaced.items():
        # what a summary replaced reaches one committed turn, once (the app drops it then)
        if states.count("committed") > 1:
            bad(("summary", f"{item} of {sid} given as replaced to "
                 f"{states.count('committed')} committed turns"))  # fmt: skip
        given = "committed" in states or "unknown" in states or reset(sid, item)
        if not given and not unseen(sid, (sid, item), replaced_at):
            bad(("summary", f"{item} of {sid} given as replaced to rolled-back turns only"))
    rep.summaries = sum("committed" in states for states in delivered.values())
    for (sid, summary), states in delivered.items():
        if states.count("committed") > 1:
            bad(("summary", f"{summary} of {sid} delivered to {states.count('committed')} "
                 "committed turns"))  # fmt: skip
        held = sid in final and summary in final[sid].items
        if "committed" not in states and not held and (sid, summary) in planned:
            # every delivery (maybe) rolled back, so queued again, and replaced while it
            # waited: it left the queue, and no later begin names it
            continue
        # (named among a later begin's replaced items: replaced after it reached a turn
        # whose outcome no reply shows, or one that may have committed)
        if (
            "committed" not in states
            and "unknown" not in states
            and (sid, summary) not in compacted
            and not unseen(sid, (sid, summary), delivered_at)
            and not reset(sid, summary)
        ):
            bad(("summary", f"{summary} of {sid} delivered only to rolled-back turns"))
        if reset(sid, summary):
            continue  # a reset since dropped it
        if not held and (sid, summary) not in compacted and not taken_unseen(sid, summary):
            bad(("lost", f"summary {summary} of {sid} delivered, not held at the end"))
    for (sid, item), recs in adds.items():
        held = final[sid].items.get(item) if sid in final else None
        took = [status(r) for r, _ in recs]
        gone = [status(r) for r in removes.get((sid, item), [])]
        if (sid, item) in compacted:
            gone.append("yes")
        elif taken_unseen(sid, item):
            gone.append("maybe")  # replaced, and delivered to a begin no reply shows
        epochs = {r.r["epoch"] for r, _ in recs if r.ok and r.r and "epoch" in r.r}
        if sid in final and epochs and max(epochs) < final[sid].epoch:
            # a reset since (the worker's, after failed compactions) dropped everything
            if held is not None:
                bad(("phantom", f"{item} of {sid} held after a reset of its epoch"))
            continue
        tokens = recs[0][1]
        if "yes" in took and all(g == "no" for g in gone) and held is None:
            r = recs[0][0]
            bad(("lost", f"{item} of {sid}: {r.op} {r.id} returned in a committed turn, not held"))
        if "yes" in gone and held is not None:
            bad(("lost", f"{item} of {sid}: released in a committed turn, still held"))
        if held is not None and all(t == "no" for t in took):
            bad(("phantom", f"{item} of {sid} held ({held}) but every {recs[0][0].op} of it "
                 "was refused or rolled back"))  # fmt: skip
        if held is not None and held != tokens:
            bad(("lost", f"{item} of {sid} held with {held} tokens, admitted with {tokens}"))
    known = {key for key in adds} | set(delivered)
    # (a summary made, delivered to a begin no reply shows)
    known |= {(r.sid, r.a["summary"]) for r in plans if taken_unseen(r.sid, r.a["summary"])}
    for sid, f in final.items():
        for item in f.items:
            if (sid, item) not in known:
                bad(("phantom", f"{item} of {sid} held but never admitted"))
        if f.open_reservations:
            bad(("reservation", f"{sid}: {f.open_reservations} reservations still open"))

    # reservations: ended at most once
    for (sid, rid), recs in enders.items():
        ended = {r.id for r in recs if status(r) == "yes"}
        if len(ended) > 1:
            bad(("reservation", f"{rid} of {sid} ended by {len(ended)} calls: {sorted(ended)}"))
    return rep
