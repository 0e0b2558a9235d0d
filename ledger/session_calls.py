"""``SessionCore``: one session's identity and epoch, and every session operation's call
builder (``<name>_call``, given to the faces by ``operation``), no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ledger import protocol
from ledger.errors import InvalidArgument
from ledger.handles import SessionHandle, _op
from ledger.models import (
    Admitted,
    BegunBy,
    CallCost,
    ChildDrawn,
    ChildOpened,
    Compaction,
    Consumer,
    Deleted,
    Item,
    Reconciled,
    Released,
    Reservation,
    ResetDone,
    Settled,
    Snapshot,
    SpanRecorded,
    ToolResult,
    TurnAborted,
    TurnFinished,
    TurnRenewed,
    TurnReport,
    TurnStarted,
    Usage,
    Voided,
)
from ledger.operations import operation
from ledger.protocol import Call


class SessionCore(SessionHandle):
    """One session's identity and epoch, and the calls it can make (no I/O).

    Each operation is a ``*_call`` method that builds its :class:`Call` and the line
    ``name = operation(name_call)`` that gives it to every face (see ``operation``).

    A handle serves one turn at a time (docs/agent.md#turn-leases): ``begin_turn`` takes
    the session's turn lease for ``owner`` (by default this process and handle), and
    until the turn ends, every call the handle makes is stamped with it (``turn``), so
    that a call from a turn that was taken over or rolled back is refused (``TurnLost``)
    instead of acting on the next one.

    The handle's owner token (128 random bits, made with the handle, never stored in
    Redis as it is nor shown by ``snapshot()``) goes with its begin_turn and with every
    call of its turn: the scripts accept a call into an open turn only with the token
    that began it, so naming another handle's turn by its number (``turn=n``) is refused
    (``TurnInProgress``), whoever knows the number or the owner's name. Handles meant to
    serve as one owner from several places (one begin_turn op id sent from each, one
    replayed) are given the same ``owner`` and ``owner_token``.
    """

    def admit_call(
        self,
        consumer: Consumer | str,
        items: Sequence[Item],
        *,
        partial: bool = False,
        texts: Sequence[str | bytes] | None = None,
        turn: int | BegunBy | None = None,
        op_id: str | None = None,
    ) -> Call[Admitted]:
        """Admit items for a consumer in one atomic step: all of them (or a refusal), or
        with ``partial=True`` the longest prefix that fits. Items already held charge nothing.
        ``texts`` (one per item): the admitted items' texts go to the content store in the
        same step, for the worker's compactor."""
        return protocol.admit(
            self.keys, _op(op_id), self._stamp(turn), consumer, items, partial, texts
        )

    admit = operation(admit_call)

    def release_call(
        self,
        consumer: Consumer | str,
        item_ids: Sequence[str],
        *,
        turn: int | BegunBy | None = None,
        op_id: str | None = None,
    ) -> Call[Released]:
        """Give back items; ids not held are reported as missing."""
        return protocol.release(self.keys, _op(op_id), self._stamp(turn), consumer, item_ids)

    release = operation(release_call)

    def reserve_call(
        self,
        consumer: Consumer | str,
        reservation_id: str,
        tokens: int,
        *,
        lease_ms: int = 30_000,
        cost: CallCost | None = None,
        turn: int | BegunBy | None = None,
        op_id: str | None = None,
    ) -> Call[Reservation]:
        """Hold an estimate until a deadline on Redis's clock (phase one of two). With
        ``cost``, a model call's worst case is held in the same step in every budget
        scope above the session (docs/ceilings.md): refused with ``CeilingReached``,
        nothing held anywhere, when one of their ceilings would be passed."""
        return protocol.reserve(
            self.keys,
            _op(op_id),
            self._stamp(turn),
            consumer,
            reservation_id,
            tokens,
            lease_ms,
            cost,
        )

    reserve = operation(reserve_call)

    def settle_call(
        self,
        reservation_id: str,
        actual: int,
        item_id: str | None = None,
        *,
        priority: int = 0,
        billed: Usage | None = None,
        scopes: Sequence[str] = (),
        turn: int | BegunBy | None = None,
        op_id: str | None = None,
    ) -> Call[Settled]:
        """Turn a reservation into an item of its actual size (lower or higher), named
        ``item_id`` (by default the reservation's id, which ``reserve`` checks is not
        held already). ``billed``: for a reservation held in budget scopes (``scopes``,
        as ``Reservation.scopes`` names them), what the provider billed: charged to them
        in the same step, more or less than held."""
        return protocol.settle(
            self.keys,
            _op(op_id),
            self._stamp(turn),
            reservation_id,
            actual,
            item_id,
            priority,
            billed,
            scopes,
        )

    settle = operation(settle_call)

    def void_call(
        self,
        reservation_id: str,
        *,
        scopes: Sequence[str] = (),
        turn: int | BegunBy | None = None,
        op_id: str | None = None,
    ) -> Call[Voided]:
        """Cancel a reservation and give its tokens back (and its holds in ``scopes``,
        as ``Reservation.scopes`` names them)."""
        return protocol.void(self.keys, _op(op_id), self._stamp(turn), reservation_id, scopes)

    void = operation(void_call)

    def open_child_call(
        self,
        reservation_id: str,
        child_id: str,
        floor: int,
        *,
        turn: int | BegunBy | None = None,
        op_id: str | None = None,
    ) -> Call[ChildOpened]:
        """Open a child (a subagent) drawing from this open reservation, ``floor`` tokens
        held for it alone; refused (``child_floor``) when the floor does not fit what the
        reservation has left, the other children unchanged (docs/ceilings.md)."""
        return protocol.open_child(
            self.keys, _op(op_id), self._stamp(turn), reservation_id, child_id, floor
        )

    open_child = operation(open_child_call)

    def draw_child_call(
        self,
        reservation_id: str,
        child_id: str,
        tokens: int,
        *,
        turn: int | BegunBy | None = None,
        op_id: str | None = None,
    ) -> Call[ChildDrawn]:
        """A child draws tokens from the reservation: within its floor always, past it
        while no other child's floor needs the room."""
        return protocol.draw_child(
            self.keys, _op(op_id), self._stamp(turn), reservation_id, child_id, tokens
        )

    draw_child = operation(draw_child_call)

    def reset_call(
        self, reason: str, *, wait_ms: int = 0, op_id: str | None = None
    ) -> Call[ResetDone]:
        """Hard reset: advance the epoch, drop every item and reservation, keep the budget.

        Fenced by this handle's epoch, so a reset delivered twice applies once. This
        handle takes the new epoch (its turn, if any, ended with the reset); every other
        handle of the session is stale until its ``refresh()``. With ``wait_ms`` above 0 a
        turn open with its lease live is not cut off: the reset is staged
        (``ResetDone.staged``) and applied by the call that ends the turn, or by a reset
        call ``wait_ms`` after it was staged (docs/rules.md#a-reset-waits-for-the-turns-end)."""
        call = protocol.reset(self.keys, _op(op_id), self.epoch, reason, wait_ms)

        def adopted(r: protocol.Reply) -> ResetDone:
            done = call.parse(r)
            if done.epoch > self.epoch:  # (a reset sent again answers its first reply)
                self.epoch, self.turn = done.epoch, None
            return done

        return Call(call.script, call.keys, call.args, adopted)

    reset = operation(reset_call)

    def begin_turn_call(
        self,
        working_set: int,
        output_reserve: int | None = None,
        *,
        takeover: bool = False,
        lease_ms: int | None = None,
        await_compaction: bool = False,
        op_id: str | None = None,
    ) -> Call[TurnStarted]:
        """Start a turn: take the session's turn lease for this handle's ``owner`` and
        gate on residual working memory vs ``working_set``
        (docs/rules.md#working-memory-starvation).

        With ``await_compaction`` a pending compaction refuses the turn
        (``CompactionPending``: whether a worker computes it now; nothing changed), so the
        caller can wait for it to land before the turn (the agent layer does).

        Another owner's open turn refuses it (``TurnInProgress``, nothing changed) unless
        its lease lapsed or ``takeover`` is given: that turn is then rolled back first.
        This handle's own open turn ends as it stands. The lease lasts ``lease_ms``
        (default: the handle's) unless renewed (``renew_turn``). Reclaims scratchpad
        (oldest first), then stale retrieval, when short; raises WorkingMemoryStarvation
        when that is not enough (a compaction is then pending). ``output_reserve``
        defaults to the budget's. The reply carries the turn's deliveries."""
        call = protocol.begin_turn(
            self.keys,
            _op(op_id),
            self.epoch,
            working_set,
            output_reserve,
            self.owner,
            self.lease_ms if lease_ms is None else lease_ms,
            takeover,
            await_compaction,
            self._token,
        )
        return Call(call.script, call.keys, call.args, self._began(call.parse))

    begin_turn = operation(begin_turn_call)

    def record_span_call(
        self,
        turn: int,
        kind: str,
        input_tokens: int,
        output_tokens: int = 0,
        *,
        op_id: str | None = None,
    ) -> Call[SpanRecorded]:
        """Account a memory-tool span before making it; FanoutRefused once the turn's
        amplification passed the pathological threshold (docs/rules.md#amplification)."""
        return protocol.record_span(
            self.keys, _op(op_id), self.epoch, turn, kind, input_tokens, output_tokens, self._token
        )

    record_span = operation(record_span_call)

    def end_turn_call(
        self,
        turn: int,
        final_prompt_tokens: int,
        *,
        p99_trend: int = 0,
        mark: str | None = None,
        op_id: str | None = None,
    ) -> Call[TurnReport]:
        """Close a turn and commit it: amplification ratio and class, compaction due?
        (docs/rules.md#amplification, docs/rules.md#compaction-credit)

        ``final_prompt_tokens`` is the real prompt's size, counted from what the model
        is sent. Its drift from occupancy is stored; beyond the budget's
        ``framing_tolerance``, or over the window, it is flagged: ContextDriftWarning,
        or ContextDrift with the setting ``drift_action="raise"`` (the turn has ended).
        ``mark`` (an id) is the app state's version this turn commits, handed to the
        next ``begin_turn`` (``TurnStarted.mark``). A turn that is not open any more
        (taken over, rolled back) raises ``TurnLost``."""
        call = protocol.end_turn(
            self.keys,
            _op(op_id),
            self.epoch,
            turn,
            final_prompt_tokens,
            p99_trend,
            self.drift_action,
            mark,
            self._token,
        )
        return Call(call.script, call.keys, call.args, self._left(turn, call.parse))

    end_turn = operation(end_turn_call)

    def finish_turn_call(
        self,
        turn: int,
        final_prompt_tokens: int,
        tools: Sequence[tuple[str, int, bytes | str]] = (),
        *,
        keep_text: bool = False,
        p99_trend: int = 0,
        mark: str | None = None,
        op_id: str | None = None,
    ) -> Call[TurnFinished]:
        """End a turn with its tool results in one call (docs/protocol.md#finish_turn):
        each ``(call id, tokens, content)`` admitted whole, then the turn ended as
        ``end_turn`` ends it, ``final_prompt_tokens`` counting those results whole. When
        one does not go in whole (no room without evicting memory, or held as a spilled
        preview) nothing changes and ``AdmissionRefused`` (reason ``not_whole``) says so:
        admit them with ``admit_tool_result`` and end the turn with ``end_turn``."""
        call = protocol.finish_turn(
            self.keys,
            _op(op_id),
            self.epoch,
            turn,
            final_prompt_tokens,
            tools,
            self._token,
            p99_trend,
            self.drift_action,
            mark,
            keep_text,
        )

        def parse(r: protocol.Reply) -> TurnFinished:
            if r.get("status") == "refused":
                return call.parse(r)
            return self._left(turn, call.parse)(r)

        return Call(call.script, call.keys, call.args, parse)

    finish_turn = operation(finish_turn_call)

    def abort_turn_call(
        self, turn: int | None = None, *, op_id: str | None = None
    ) -> Call[TurnAborted]:
        """Roll back an open turn (by default this handle's): what it added goes, what it
        released, reclaimed, evicted or compacted away comes back, its deliveries are
        queued again and its lease ends (docs/agent.md#a-dead-turn-is-undone). A turn no
        longer open is left alone (``rolled_back`` None)."""
        t = self.turn if turn is None else turn
        if t is None:
            raise InvalidArgument(
                "abort_turn: this handle holds no turn; name the turn to roll back"
            )
        call = protocol.abort_turn(self.keys, _op(op_id), self.epoch, t, self._token)
        return Call(call.script, call.keys, call.args, self._left(t, call.parse))

    abort_turn = operation(abort_turn_call)

    def renew_turn_call(
        self, turn: int | None = None, lease_ms: int | None = None, *, op_id: str | None = None
    ) -> Call[TurnRenewed]:
        """Extend the open turn's lease (by default this handle's) to ``lease_ms`` from now
        (default: the handle's lease); ``TurnLost`` when the turn is not open any more."""
        t = self.turn if turn is None else turn
        if t is None:
            raise InvalidArgument("renew_turn: this handle holds no turn")
        lease = self.lease_ms if lease_ms is None else lease_ms
        return protocol.renew_turn(self.keys, _op(op_id), self.epoch, t, lease, self._token)

    renew_turn = operation(renew_turn_call)

    def reconcile_call(
        self,
        items: Mapping[Any, Sequence[Item]],
        *,
        turn: int | BegunBy | None = None,
        op_id: str | None = None,
    ) -> Call[Reconciled]:
        """Set each named consumer's items to exactly ``items[consumer]`` in one atomic
        step (releases the others, adds the new, resizes the changed); consumers not
        named are untouched. Refused (nothing changed) when the result does not fit.
        Clears a flagged drift."""
        return protocol.reconcile(self.keys, _op(op_id), self._stamp(turn), items)

    reconcile = operation(reconcile_call)

    def compact_call(
        self,
        replaced: Sequence[str | tuple[Consumer | str, str]],
        summary: Item | None,
        *,
        summary_text: str | None = None,
        turn: int | BegunBy | None = None,
        op_id: str | None = None,
    ) -> Call[Compaction]:
        """Commit a compaction: ``replaced`` items (working-memory ids, or (consumer, id)
        pairs for stale chunks and tool results) give way to one working-memory
        ``summary``. Above the high-water mark it is a failed compaction, and repeated
        failures enqueue a hard reset (docs/rules.md#compaction-credit). ``summary_text``
        is stored with the effect (the replaced items' texts leave the content store)."""
        return protocol.compact(
            self.keys, _op(op_id), self._stamp(turn), replaced, summary,
            summary_text=summary_text,
        )  # fmt: skip

    compact = operation(compact_call)

    def admit_tool_result_call(
        self,
        call_id: str,
        tokens: int,
        content: bytes | str,
        *,
        keep_text: bool = False,
        turn: int | BegunBy | None = None,
        op_id: str | None = None,
    ) -> Call[ToolResult]:
        """Admit a tool result whole, or spill it to a handle with a bounded preview
        (docs/rules.md#admission-with-spill); never truncated. Memory gives way first.
        ``keep_text``: the result, admitted or spilled, also goes to the content store."""
        return protocol.admit_tool(
            self.keys, _op(op_id), self._stamp(turn), call_id, tokens, content, keep_text
        )

    admit_tool_result = operation(admit_tool_result_call)

    def snapshot_call(self) -> Call[Snapshot]:
        """A consistent reading of the session's numbers."""
        return protocol.snapshot(self.keys)

    snapshot = operation(snapshot_call)

    def delete_call(self, *, op_id: str | None = None) -> Call[Deleted]:
        """Delete the session for every worker and handle: its items, reservations and
        index entries (a short tombstone keeps the retry's answer and fences old epochs).
        Not to be confused with ``Ledger.close()``, which closes a connection."""
        return protocol.delete(self.keys, _op(op_id), self.epoch)

    delete = operation(delete_call)
