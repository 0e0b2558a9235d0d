"""Renewing a turn's lease while the turn runs: on the process's lease thread (sync) or
as a task (asyncio).

A turn holds the session's lease for ``lease_ms`` (docs/agent.md#turn-leases); a model
call or a tool may take longer. The agent layer's turn renews it every third of the
lease in the background, so that only a dead process loses its turn. The two faces'
``Turn`` use the class of their kind; everything else about a turn is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable

from ledger.errors import TurnLost


class _Beats:
    """One daemon thread per process that runs every live :class:`Heartbeat` when due: a
    turn starts no thread of its own (starting and joining one per turn cost more than
    the rest of a short turn's client work). Made again in a forked child."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.due: list[tuple[float, int, Heartbeat]] = []
        self.cond = threading.Condition()
        self.seq = 0
        # when the thread wakes next by itself (-inf while it runs a beat): a heartbeat
        # due later needs no wake-up (a turn's own is due a third of a lease after the
        # last turn's, ended or not), so a turn costs the thread no switch
        self.until = math.inf
        self.thread = threading.Thread(target=self._run, name="ledger-turn-leases", daemon=True)
        self.thread.start()

    def add(self, hb: Heartbeat) -> None:
        with self.cond:
            self.seq += 1
            due = time.monotonic() + hb.interval
            heapq.heappush(self.due, (due, self.seq, hb))
            if due < self.until:
                self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.due or self.due[0][0] > time.monotonic():
                    self.until = self.due[0][0] if self.due else math.inf
                    self.cond.wait(self.until - time.monotonic() if self.due else None)
                self.until = -math.inf
                _, _, hb = heapq.heappop(self.due)
                if hb.stopped:
                    continue
                hb.running = True
            again = hb.run_once()
            with self.cond:
                hb.running = False
                if hb.waited:  # a stop() waits for this beat's end
                    self.cond.notify_all()
                if again and not hb.stopped:
                    self.seq += 1
                    heapq.heappush(self.due, (time.monotonic() + hb.interval, self.seq, hb))


_BEATS: _Beats | None = None
_BEATS_LOCK = threading.Lock()


def _beats() -> _Beats:
    global _BEATS
    with _BEATS_LOCK:
        if _BEATS is None or _BEATS.pid != os.getpid():
            _BEATS = _Beats()
        return _BEATS


def _stopped() -> None:
    """The beat of a stopped heartbeat (never called: the lease thread skips it)."""


class Heartbeat:
    """Calls ``beat()`` every ``interval`` seconds, on the process's lease thread, until
    :meth:`stop` or until a beat raises :class:`TurnLost` (kept in ``lost``). Other errors
    (Redis away for a moment) are kept in ``last_error`` and the next beat tries again."""

    def __init__(self, beat: Callable[[], object], interval: float) -> None:
        self.beat, self.interval = beat, interval
        self.lost: TurnLost | None = None
        self.last_error: Exception | None = None
        self.beats = 0
        self.stopped = False
        # a beat runs now (set and cleared by the lease thread under its condition); a
        # stop() waiting for its end (no Event per turn: a stop rarely meets a beat)
        self.running = self.waited = False

    def start(self) -> None:
        _beats().add(self)

    def run_once(self) -> bool:
        """One beat; whether to beat again."""
        try:
            self.beat()
            self.beats += 1
        except TurnLost as exc:
            self.lost = exc
            return False
        except Exception as exc:
            self.last_error = exc
        return True

    def stop(self) -> None:
        """No beat after this returns (one running now is waited for)."""
        beats = _BEATS
        if beats is None:
            self.stopped = True
            return
        with beats.cond:  # the lease thread decides under it whether to beat
            self.stopped = True
            if self.running and threading.current_thread() is not beats.thread:
                self.waited = True
                beats.cond.wait_for(lambda: not self.running, timeout=30)
            if not self.running:
                # the heap keeps a stopped heartbeat until it is due: not its turn too
                # (every object of the turn would live that long, and the GC walk them)
                self.beat = _stopped


class AsyncHeartbeat:
    """:class:`Heartbeat` as an asyncio task on the running loop."""

    def __init__(self, beat: Callable[[], Awaitable[object]], interval: float) -> None:
        self.beat, self.interval = beat, interval
        self.lost: TurnLost | None = None
        self.last_error: Exception | None = None
        self.beats = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="ledger-turn-lease")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.beat()
                self.beats += 1
            except TurnLost as exc:
                self.lost = exc
                return
            except Exception as exc:
                self.last_error = exc

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None or task.done():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
