"""The job kinds: a compaction (the compactor's plan committed by ``compact.lua``:
between turns, or staged while a turn is open to land at the next ``begin_turn``) and a
hard reset (``reset.lua``), each fenced by the epoch it was enqueued at, so that a job
delivered twice changes the state once."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import threading
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from ledger import schema
from ledger.errors import LedgerError, OperationIdReused, StaleEpoch, UnknownSession
from ledger.keys import SessionKeys
from ledger.models import CompactionOutcome, HeldItem, JobKind, Snapshot
from ledger.workers import compactors
from ledger.workers.calls import LedgerCalls
from ledger.workers.settings import WorkerSettings

T = TypeVar("T")


class JobEffect(enum.StrEnum):
    """What a job did (the ``effect`` of the worker's "job done" log line)."""

    APPLIED = "applied"  # its change was made now
    ALREADY = "already"  # made before (a job delivered again): nothing changed
    SKIPPED = "skipped"  # not due any more (another incarnation, another owner): nothing changed


@dataclass
class JobOutcome:
    kind: JobKind
    effect: JobEffect


class JobDeferred(LedgerError):
    """A job left pending, its delivery uncounted, for a later claim: not a failure."""


class CompactionDeferred(JobDeferred):
    """A compaction job left pending, its delivery uncounted, for a later claim. (A
    compaction that finds a turn open is staged, not deferred: compact.lua.)"""


class ResetStaged(JobDeferred):
    """A hard reset staged for the session's open turn's end (reset.lua): its job is left
    pending, uncounted; a later claim finds it applied by the turn's end (then the reset
    call is stale: done already) or applies it once ``reset_wait`` has passed."""


class Jobs:
    """A worker's job handlers, and the event loop its async compactors run on."""

    def __init__(
        self,
        calls: LedgerCalls,
        settings: WorkerSettings,
        compactor: compactors.AnyCompactor | None,
    ) -> None:
        self.calls = calls
        self.settings = settings
        self.compactor = compactor  # None: compaction jobs are left for another worker
        self._loop: asyncio.AbstractEventLoop | None = None  # for async compactors
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()

    def close(self) -> None:
        """Stop the async compactors' event loop."""
        with self._loop_lock:
            loop, thread, self._loop = self._loop, self._loop_thread, None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()

    def _run_compactor(
        self, compactor: compactors.AnyCompactor, request: compactors.CompactionRequest
    ) -> compactors.CompactionPlan:
        """A sync compactor in this job thread; an async one on the worker's event loop
        (one loop, many summaries in flight), this thread waiting for its result."""
        got = compactor(request)
        if not inspect.isawaitable(got):
            return got
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._loop_thread = threading.Thread(
                    target=loop.run_forever, name="ledger-compact", daemon=True
                )
                self._loop_thread.start()
                self._loop = loop
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(_awaited(got), loop).result()

    def handle(self, job_id: str, fields: Mapping[str, str]) -> JobOutcome:
        job = schema.JobEntry.from_fields(fields)  # KeyError, ValueError: a malformed entry
        if job.kind == JobKind.HARD_RESET:
            return self._hard_reset(job_id, job)
        return self._compact(job_id, job)

    def same_incarnation(self, snap: Snapshot, job: schema.JobEntry) -> bool:
        """A job belongs to the session it was enqueued for, not to a later one that was
        opened under the same id after the first was closed or expired."""
        return job.inc == 0 or snap.raw.get(schema.INCARNATION, 0) == job.inc

    def _hard_reset(self, job_id: str, f: schema.JobEntry) -> JobOutcome:
        # Applied once however late it is delivered again, even after the op retention
        # dropped its stored outcome: the reset moves the session from the job's epoch e
        # to e + 1, and reset.lua refuses a call fenced at e as stale from then on.
        keys = self.calls.session_keys(f.session)
        try:
            snap = self.calls.snapshot(keys)
        except UnknownSession:
            return JobOutcome(JobKind.HARD_RESET, JobEffect.SKIPPED)
        if not self.same_incarnation(snap, f):
            return JobOutcome(JobKind.HARD_RESET, JobEffect.SKIPPED)
        # A live open turn is not cut off: the reset is staged for the turn's end (the call
        # that ends it applies it), and this job stays pending until then, or until
        # reset_wait has passed (the same op id: a staged reply is not stored, so a claim
        # of the job is judged again, and applies it once it is due).
        try:
            done = self.calls.reset(
                keys, f"job-{job_id}", f.epoch, f.reason or "job",
                round(self.settings.reset_wait * 1000),
            )  # fmt: skip
        except (StaleEpoch, UnknownSession, OperationIdReused):
            return JobOutcome(JobKind.HARD_RESET, JobEffect.ALREADY)
        if done.staged:
            raise ResetStaged(
                f"hard reset of session {f.session!r} staged for the end of its turn "
                f"{done.turn} (applied anyway from {done.due_ms} ms, Redis's clock)"
            )
        return JobOutcome(JobKind.HARD_RESET, JobEffect.APPLIED)

    def _compact(self, job_id: str, f: schema.JobEntry) -> JobOutcome:
        sid, epoch = f.session, f.epoch
        keys = self.calls.session_keys(sid)
        try:
            snap = self.calls.snapshot(keys)
        except UnknownSession:
            return JobOutcome(JobKind.COMPACT, JobEffect.SKIPPED)
        if not self.same_incarnation(snap, f):
            return JobOutcome(JobKind.COMPACT, JobEffect.SKIPPED)
        if snap.epoch != epoch or not snap.compaction_pending:
            return JobOutcome(JobKind.COMPACT, JobEffect.ALREADY)
        if snap.raw.get(schema.AGENT_COMPACTS):
            # The agent compacts this session inline (a job from before an ownership
            # change, or written by hand): the worker keeps out.
            return JobOutcome(JobKind.COMPACT, JobEffect.SKIPPED)
        compactor = self.compactor
        if compactor is None:
            # Not this worker's job: it stays pending, its delivery uncounted (never
            # dead-lettered for it), for a worker with a compactor to take over.
            raise CompactionDeferred(
                f"worker-owned session {sid!r} has a compaction due and this worker runs no "
                "compactor (--compactor none): left pending for a worker with a compactor"
            )
        if snap.raw.get(schema.RESET_REQUESTED):
            # Failed compactions escalated: a hard reset is coming, which drops what a
            # compaction would replace. Running the compactor again would only count
            # failures past the maximum.
            return JobOutcome(JobKind.COMPACT, JobEffect.SKIPPED)
        turn, items = self.calls.history(keys)
        contents = self.calls.contents(keys, items)
        self.calls.mark_compacting(
            keys,
            self.settings.consumer,
            self.settings.turn_wait + 60,
            int(snap.raw.get(schema.IDLE_TTL) or 86_400_000),
        )
        try:
            return self._compact_with(
                compactor, keys, job_id, sid, epoch, snap, turn, items, contents
            )
        finally:
            # (if this fails, the mark says so until its time is up)
            with contextlib.suppress(LedgerError):
                self.calls.unmark_compacting(keys)

    def _compact_with(
        self,
        compactor: compactors.AnyCompactor,
        keys: SessionKeys,
        job_id: str,
        sid: str,
        epoch: int,
        snap: Snapshot,
        turn: int,
        items: tuple[HeldItem, ...],
        contents: dict[str, str],
    ) -> JobOutcome:
        """Plan (the compactor) and commit: applied now between turns, or staged while a
        turn is open (compact.lua), to land at the session's next begin_turn. Either way
        it is judged on the history the compactor read: the items admitted after it (a
        turn that ran meanwhile) are not held against the summary."""
        plan = self._run_compactor(
            compactor,
            compactors.CompactionRequest(
                session_id=sid,
                epoch=epoch,
                turn=turn,
                items=items,
                occupancy=snap.occupancy,
                high_water_mark=snap.high_water_mark,
                window=snap.window,
                contents=contents,
            ),
        )
        # Each replaced item at the version the compactor read: one released and admitted
        # again since (with other text) stays.
        seqs = {(i.consumer, i.id): i.seq for i in items}
        replaced = [(c, i, seqs[(c, i)]) if (c, i) in seqs else (c, i) for c, i in plan.replaced]
        # The job's entry id goes with the call: compact.lua deletes the entry with the
        # effect (or the staging), and answers 'already' when it is gone (committed before,
        # by a worker that died before acknowledging it), whatever the op retention. The
        # summary's text goes with it: stored with the effect, the replaced versions' texts
        # removed with it (an item admitted again since keeps its new text).
        text = plan.summary_text if plan.summary is not None else None
        try:
            done = self.calls.compact(
                keys, f"job-{job_id}", epoch, replaced, plan.summary, job=job_id,
                summary_text=text, read=max((i.seq for i in items), default=0),
            )  # fmt: skip
        except (StaleEpoch, UnknownSession, OperationIdReused):
            return JobOutcome(JobKind.COMPACT, JobEffect.ALREADY)
        already = done.outcome == CompactionOutcome.ALREADY
        return JobOutcome(JobKind.COMPACT, JobEffect.ALREADY if already else JobEffect.APPLIED)


async def _awaited(aw: Awaitable[T]) -> T:
    return await aw
