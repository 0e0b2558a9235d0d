"""Billing: a model call's hold, and its prompt as counted against what the provider
billed (:class:`BillingCheck`), which calibrates the counter."""

from __future__ import annotations

import json
import math
import uuid
import warnings

from ledger.agent.calibration import CALIBRATION, REPORTS_KEPT, _solve
from ledger.agent.counters import PLAUSIBLE, Tally
from ledger.agent.effects import Note, Obj, Op, Store
from ledger.agent.items import AgentBase
from ledger.agent.telemetry import added
from ledger.agent.turns import BillingCheck, CallHold, TurnState
from ledger.errors import (
    AdmissionRefused,
    BillingDriftWarning,
    InvalidArgument,
)
from ledger.models import (
    CallCost,
    Consumer,
    Settled,
    Usage,
    Voided,
)
from ledger.protocol import ID_RE

BILLED = "~billed"  # '<turn>|<counted>|<billed>|<flagged 0/1>': the last turn's last report


def framing_hint(report: object, state: TurnState | None) -> str | None:
    """When a flagged drift is the tool schemas' tokens the prompt sent (within the
    tolerance): what is missing is the budget's ``tool_framing``, named with its value."""
    drift = getattr(report, "drift", 0)
    tolerance = getattr(report, "tolerance", None) or 0
    framing = 0 if state is None else state.framing
    if getattr(report, "flag", None) != "drift" or framing <= 0:
        return None
    if abs(drift - framing) > tolerance:
        return None
    return (
        f"the drift is the {framing} tokens of the tool schemas the prompt sent: the "
        f"session's budget has no tool_framing for them (SessionBudget(tool_framing={framing}))"
    )


def billing_message(c: BillingCheck) -> str:
    learned = ", ".join(f"{k} x{f:g}" for k, f in sorted((c.learned or {}).items()))
    why = (
        f"the counter is off; the factors learned from it ({learned}) are applied from the "
        "next turn"
        if c.learned
        else "the counter is off (an estimate? Agent(calibrate=True) learns its factors)"
        if c.plausible
        else "the report is outside what an estimate can be off by (0.5-2x of each kind's "
        "prior): it covers what the count did not (a system message, tool schemas, images?), "
        "far less, or is wrong: nothing learned from it; count the prompt the provider bills"
    )
    return (
        f"turn {c.turn}: the provider billed {c.billed} input tokens for a prompt the ledger "
        f"counted at {c.counted} ({c.difference:+d}, tolerance {c.tolerance}): {why}"
    )


class Billing(AgentBase):
    """The agent's billing operations: what the provider billed for a prompt, and a
    model call's hold in the budget scopes (settled or voided)."""

    def billed(
        self, state: TurnState, billed: int, counted: int, tally: Tally | None = None
    ) -> Op[BillingCheck]:
        """What the provider billed for a prompt (its reported input tokens) against the
        ledger's count of that prompt: flagged beyond ``billing_tolerance`` (a
        BillingDriftWarning). ``tally``: what the count was made of (the base's counts by
        kind, ``Calibrated.measure``); by default the last prompt measured, when its total
        is ``counted``.

        When this agent calibrates (its counter estimates), a plausible report (between
        0.5 and 2 times each kind's prior estimate of the prompt) is kept in Redis with
        the last ones, and a flagged one teaches the kinds it tells enough of a factor
        solved from the kept reports against the base's counts (never against a calibrated
        count: reports do not compound), for every process from the next turn on. A report
        outside that range, whatever its size, is flagged and not learned: one wrong or
        hostile report cannot move the fleet's counts past a kind's bound."""
        for name, v in (("billed", billed), ("counted", counted)):
            if type(v) is not int or v < 0:
                raise InvalidArgument(f"{name} tokens must be a non-negative int, got {v!r}")
        if tally is None:
            last = self.counter.last
            tally = last if last is not None and last.counted <= counted else Tally()
        tolerance = math.ceil(self.billing_tolerance * counted)
        flagged = abs(billed - counted) > tolerance
        # the tokens the counter did not count (item_overhead, framing) are billed alike
        fixed = counted - tally.counted
        text = billed - fixed
        raw = {k: n for k, n in tally.raw.items() if n > 0}
        prior = sum(n * self.counter.priors[k] for k, n in raw.items())
        plausible = prior >= 64 and PLAUSIBLE[0] * prior <= text <= PLAUSIBLE[1] * prior
        learned = None
        if self.calibrate and plausible:
            self.reports = [*self.reports, [state.turn, raw, text]][-REPORTS_KEPT:]
            factors = dict(self.counter.factors)
            solved = _solve(self.reports, factors, self.counter.priors)
            new = {k: f for k, f in solved.items() if factors.get(k) != f}
            # taught when the count is off, or when the kept reports move this prompt's
            # count by 2 tokens or more (a factor from a small report is refined by the
            # larger ones after it, before its error grows with the prompt)
            shift = sum(abs(f - factors.get(k, f)) * raw.get(k, 0) for k, f in new.items())
            if new and (flagged or shift >= 2 or not factors.keys() >= new.keys()):
                learned = new
                factors.update(new)
            record = {"v": 1, "factors": factors, "reports": self.reports}
            yield Note(((CALIBRATION, json.dumps(record, sort_keys=True)),))
        check = BillingCheck(
            turn=state.turn,
            counted=counted,
            billed=billed,
            tolerance=tolerance,
            flagged=flagged,
            plausible=plausible,
            learned=learned,
        )
        state.billing.append(check)
        if flagged:
            warnings.warn(BillingDriftWarning(check, billing_message(check)), stacklevel=4)
        return check

    def hold(self, prompt: int, output: int, model: str | None, turn: int) -> Op[CallHold]:
        """Before a model call: hold its worst case, ``prompt`` (the tokens the adapter
        counted and the ledger admitted) plus ``output`` (the turn's output reserve), in the
        session's window and in the tenant's scopes, in one script. A ceiling that would be
        passed refuses it (``CeilingReached``), nothing held anywhere: the model is not
        called. ``model``: the framework's model name (else the agent's ``model``)."""
        if self.tenant is None:
            raise InvalidArgument("no tenant named: name_tenant(...) or Agent(tenant=...)")
        name = self.model if model is None or not ID_RE.fullmatch(model) else model
        cost = CallCost(
            model=name or "default",
            input=max(int(prompt), 0),
            output=max(int(output), 0),
            scopes=(self.tenant, *self.scopes),
        )
        rid = f"call.{turn}.{uuid.uuid4().hex[:12]}"
        tokens = max(cost.output, 1)
        got = yield self.session.reserve_call(
            Consumer.WORKING_MEMORY, rid, tokens, lease_ms=self.hold_ms, cost=cost, turn=turn
        )
        return CallHold(rid, tokens, cost, got.scopes)

    def settle_hold(
        self, state: TurnState, hold: CallHold, answer: Obj | None, billed: Usage | None
    ) -> Op[Settled]:
        """After the call: the hold becomes what the provider billed (``billed``; None: no
        usage reported, the worst case held is charged) in the tenant's scopes, and the
        answer's item (working memory, its count) in the session's window, in one script;
        billed past the hold is charged all the same and reported (``Settled.over``, kept
        on ``state.settled``). The answer's later admission finds it held (no charge)."""
        usage = billed or Usage(
            input=hold.cost.input, output=hold.cost.output, cached_input=hold.cost.cached_input
        )
        c = Consumer.WORKING_MEMORY
        iid, size = (hold.id, 1) if answer is None else (self.item_id(answer), self.tokens(answer))
        try:
            done: Settled = yield self.session.settle_call(
                hold.id, max(size, 1), iid, billed=usage, scopes=hold.scopes, turn=state.turn
            )
        except AdmissionRefused:
            # the answer counts more than its hold and the window has no room for the rest:
            # its item keeps the hold's size (the drift shows it at end_turn); the billed
            # usage is charged all the same
            done = yield self.session.settle_call(
                hold.id, hold.tokens, iid, billed=usage, scopes=hold.scopes, turn=state.turn
            )
        if answer is None:  # nothing to name the tokens after: given back
            yield self.session.release_call(c, [iid], turn=state.turn)
        else:
            self.known[(c, iid)] = answer
            self.answered.add(iid)
            if (yield from self._storing()):  # the compactor reads the answer's text
                yield Store(((f"{c.code}:{iid}", self.text_of(answer)),))
        state.settled.append(done)
        state.usage = added(state.usage, usage)
        return done

    def void_hold(self, hold: CallHold, turn: int) -> Op[Voided]:
        """The call failed: its hold given back, in the session and in every scope."""
        done: Voided = yield self.session.void_call(hold.id, scopes=hold.scopes, turn=turn)
        return done
