"""Renewing a turn's lease while the turn runs: a thread (sync) or a task (asyncio).

A turn holds the session's lease for ``lease_ms`` (docs/agent.md#turn-leases); a model
call or a tool may take longer. The agent layer's turn renews it every third of the
lease in the background, so that only a dead process loses its turn. The two faces'
``Turn`` use the class of their kind; everything else about a turn is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable

from ledger.errors import TurnLost


class Heartbeat:
    """Calls ``beat()`` every ``interval`` seconds in a daemon thread until :meth:`stop`
    or until a beat raises :class:`TurnLost` (kept in ``lost``). Other errors (Redis
    away for a moment) are kept in ``last_error`` and the next beat tries again."""

    def __init__(self, beat: Callable[[], object], interval: float) -> None:
        self.beat, self.interval = beat, interval
        self.lost: TurnLost | None = None
        self.last_error: Exception | None = None
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ledger-turn-lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
                self.beats += 1
            except TurnLost as exc:
                self.lost = exc
                return
            except Exception as exc:
                self.last_error = exc

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)


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
