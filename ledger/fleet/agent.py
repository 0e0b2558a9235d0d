"""The simulated agents' view of the ledger: one small interface over a session.

The demo's agents do what an agent built on the ledger does each turn: open the turn
at its declared working set, admit what the turn puts in the prompt, wait a bounded
time for a pending compaction instead of piling memory onto a baseline that is about
to change, spill oversized tool results, account memory-tool spans, and close the
turn with its final prompt. Everything goes through :class:`SimAgent`, so when the
package's agent layer (``ledger.agent``) is available the demo switches to it here,
in one place. Kept thin on purpose: it holds no allocation logic of its own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ledger.client import Ledger, Session
from ledger.errors import AdmissionRefused, FanoutRefused, StaleEpoch
from ledger.models import (
    Admitted,
    Consumer,
    Item,
    SessionBudget,
    Snapshot,
    ToolResult,
    TurnReport,
    TurnStarted,
)

POLL_S = 0.004


@dataclass
class MemoryOutcome:
    """What became of one memory admission (retrieval or recall) in a turn."""

    admitted: Admitted | None
    refusals: list[AdmissionRefused] = field(default_factory=list)
    waited: bool = False  # waited for a pending compaction before the verdict

    @property
    def ok(self) -> bool:
        return self.admitted is not None


class SimAgent:
    """One agent session on the ledger (sync). Calls after a hard reset raise
    :class:`StaleEpoch` once; :meth:`adopt_reset` takes the new epoch."""

    def __init__(self, ledger: Ledger, session_id: str, budget: SessionBudget) -> None:
        self.ledger = ledger
        self.session: Session = ledger.open_session(session_id, budget)
        self.turn = 0
        self.calls = 0
        self.refusals: list[AdmissionRefused] = []  # every memory refusal, in order
        self.waits = 0  # bounded waits for a pending compaction

    # --- the turn ------------------------------------------------------------------

    def begin(self, working_set: int, output_reserve: int | None = None) -> TurnStarted:
        self.calls += 1
        t = self.session.begin_turn(working_set, output_reserve)
        self.turn = t.turn
        return t

    def admit(self, consumer: Consumer, items: Sequence[Item]) -> Admitted:
        self.calls += 1
        return self.session.admit(consumer, list(items))

    def admit_memory(
        self, consumer: Consumer, items: Sequence[Item], wait_s: float
    ) -> MemoryOutcome:
        """Admit a set of memory items whole. Refused because a compaction is pending:
        wait up to ``wait_s`` for it to land, then ask once more."""
        out = MemoryOutcome(None)
        for attempt in range(2):
            try:
                out.admitted = self.admit(consumer, items)
                return out
            except StaleEpoch:
                raise
            except AdmissionRefused as exc:
                out.refusals.append(exc)
                self.refusals.append(exc)
                if exc.reason != "compaction_pending" or attempt == 1:
                    return out
                out.waited = True
                self.waits += 1
                if not self.wait_compaction(wait_s):
                    return out
        return out

    def release(self, consumer: Consumer, ids: Sequence[str]) -> None:
        if ids:
            self.calls += 1
            self.session.release(consumer, list(ids))

    def tool_result(self, call_id: str, tokens: int, content: bytes) -> ToolResult:
        self.calls += 1
        return self.session.admit_tool_result(call_id, tokens, content)

    def span(self, kind: str, input_tokens: int, output_tokens: int) -> bool:
        """Account a memory-tool span before making the call; False: the fan-out guard
        says summarize and proceed instead."""
        self.calls += 1
        try:
            self.session.record_span(self.turn, kind, input_tokens, output_tokens)
        except FanoutRefused:
            return False
        return True

    def end(self, final_prompt_tokens: int, p99_trend: int = 0) -> TurnReport:
        self.calls += 1
        return self.session.end_turn(self.turn, final_prompt_tokens, p99_trend=p99_trend)

    def snapshot(self) -> Snapshot:
        self.calls += 1
        return self.session.snapshot()

    # --- compactions run by the background worker ------------------------------------

    def wait_compaction(self, timeout_s: float) -> bool:
        """Wait (bounded) until no compaction is pending: one landed, or the failed ones
        escalated to a hard reset. True when memory may be asked for again."""
        first = self.snapshot()
        deadline = time.monotonic() + timeout_s
        snap = first
        while snap.compaction_pending and snap.epoch == first.epoch:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
            snap = self.snapshot()
        return True

    def wait_attempt(self, before: Snapshot, timeout_s: float) -> bool:
        """Wait (bounded) for the worker's next verdict on the pending compaction: a
        compaction, a failed one, or a hard reset. True if one arrived in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            snap = self.snapshot()
            if (
                not snap.compaction_pending
                or snap.epoch != before.epoch
                or snap.raw.get("x:failed_compactions", 0)
                != before.raw.get("x:failed_compactions", 0)
            ):
                return True
            time.sleep(POLL_S)
        return False

    def adopt_reset(self) -> int:
        """After a hard reset: take the session's new epoch (its items are gone)."""
        self.calls += 1
        return self.session.refresh()

    def close(self) -> None:
        self.session.close()
