"""The ledger's single-item admission written the two conventional ways, without Lua:
the baselines of bench_full. Both decide the same on a hash ``window``, ``used``,
``i:<item id>``: an item already held is a duplicate (nothing charged); one that would
take ``used`` above ``window`` is refused (nothing written); otherwise HINCRBY used and
HSET the item in one MULTI/EXEC.

WatchAdmit (and AsyncWatchAdmit): WATCH, HMGET, decide, MULTI/HINCRBY/HSET/EXEC, the
whole step retried at once on WatchError (redis-py's ``Redis.transaction`` idiom).
LockAdmit (and AsyncLockAdmit): the same under a redis-py ``Lock`` (SET NX PX, polled
every LOCK_SLEEP s, released by a compare-and-delete script; correct while no holder
stalls past its 10 s timeout).

They do not do what the ledger does on every call (op ids with a stored outcome,
floors, epochs, turns, TTLs): the comparison is generous to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
from redis.exceptions import WatchError

WINDOW = "window"
USED = "used"
ITEM = "i:"

# Commands each implementation issues that run *inside* another command and are
# therefore already in that command's INFO commandstats usec (EXEC includes the
# commands it runs; a script includes the commands it calls). Summing them again
# would count them twice.
WATCH_NESTED = ("hincrby", "hset")  # queued between MULTI and EXEC
LOCK_NESTED = ("hincrby", "hset", "get", "del")  # + GET/DEL inside Lock's release script
LOCK_SLEEP = 0.001  # seconds between tries while another client holds the lock (redis-py: 0.1)
WATCH_MAX_RETRIES = 100_000


class NoSession(LookupError):
    """The session hash does not exist (never opened)."""


class TooManyRetries(RuntimeError):
    """An optimistic transaction lost the race more than ``max_retries`` times."""


@dataclass(frozen=True, slots=True)
class AltResult:
    status: str  # "ok" | "duplicate" | "refused"
    charged: int
    free: int
    retries: int = 0


def open_session(r: redis.Redis, key: str, window: int) -> bool:
    """Create the session hash (window, used=0) unless it exists, atomically; True when
    created. Opening an existing session leaves it as it is."""
    with r.pipeline(transaction=True) as pipe:
        pipe.hsetnx(key, WINDOW, window)
        pipe.hsetnx(key, USED, 0)
        created, _ = pipe.execute()
    return bool(created)


def decide(values: list[Any], tokens: int) -> tuple[str, int, int]:
    """(status, charged, free) from HMGET window, used, i:<id>; raises NoSession."""
    window, used, held = values
    if window is None or used is None:
        raise NoSession("session hash does not exist")
    free = int(window) - int(used)
    if held is not None:
        return "duplicate", 0, free
    if tokens > free:
        return "refused", 0, free
    return "ok", tokens, free - tokens


def _check_tokens(tokens: int) -> None:
    if type(tokens) is not int or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")


# --- WATCH / MULTI / EXEC ------------------------------------------------------------


class _Admit:
    def __init__(self, r: Any) -> None:
        self.r = r


class WatchAdmit(_Admit):
    """Single-item admission as an optimistic transaction (sync)."""

    def admit(self, key: str, item_id: str, tokens: int) -> AltResult:
        _check_tokens(tokens)
        field = ITEM + item_id
        retries = 0
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    status, charged, free = decide(pipe.hmget(key, WINDOW, USED, field), tokens)
                    if status != "ok":
                        pipe.unwatch()
                        return AltResult(status, 0, free, retries)
                    pipe.multi()
                    pipe.hincrby(key, USED, tokens)
                    pipe.hset(key, field, tokens)
                    pipe.execute()
                    return AltResult(status, charged, free, retries)
                except WatchError:
                    retries += 1
                    if retries > WATCH_MAX_RETRIES:
                        raise TooManyRetries(f"{key}: lost {retries} races") from None
                    pipe.reset()


class AsyncWatchAdmit(_Admit):
    """Single-item admission as an optimistic transaction (asyncio)."""

    async def admit(self, key: str, item_id: str, tokens: int) -> AltResult:
        _check_tokens(tokens)
        field = ITEM + item_id
        retries = 0
        async with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    values = await pipe.hmget(key, WINDOW, USED, field)
                    status, charged, free = decide(values, tokens)
                    if status != "ok":
                        await pipe.unwatch()
                        return AltResult(status, 0, free, retries)
                    pipe.multi()
                    pipe.hincrby(key, USED, tokens)
                    pipe.hset(key, field, tokens)
                    await pipe.execute()
                    return AltResult(status, charged, free, retries)
                except WatchError:
                    retries += 1
                    if retries > WATCH_MAX_RETRIES:
                        raise TooManyRetries(f"{key}: lost {retries} races") from None
                    await pipe.reset()


# --- redis-py Lock around read-modify-write -----------------------------------------


class LockAdmit(_Admit):
    """Single-item admission under a redis-py ``Lock`` per session (sync)."""

    def admit(self, key: str, item_id: str, tokens: int) -> AltResult:
        _check_tokens(tokens)
        field = ITEM + item_id
        lock = self.r.lock(key + ":lock", timeout=10.0, sleep=LOCK_SLEEP, blocking_timeout=60.0)
        with lock:  # raises LockError when not acquired within blocking_timeout
            status, charged, free = decide(self.r.hmget(key, WINDOW, USED, field), tokens)
            if status == "ok":
                with self.r.pipeline(transaction=True) as pipe:
                    pipe.hincrby(key, USED, tokens)
                    pipe.hset(key, field, tokens)
                    pipe.execute()
        return AltResult(status, charged, free)


class AsyncLockAdmit(_Admit):
    """Single-item admission under a redis-py ``Lock`` per session (asyncio)."""

    async def admit(self, key: str, item_id: str, tokens: int) -> AltResult:
        _check_tokens(tokens)
        field = ITEM + item_id
        lock = self.r.lock(key + ":lock", timeout=10.0, sleep=LOCK_SLEEP, blocking_timeout=60.0)
        async with lock:
            values = await self.r.hmget(key, WINDOW, USED, field)
            status, charged, free = decide(values, tokens)
            if status == "ok":
                async with self.r.pipeline(transaction=True) as pipe:
                    pipe.hincrby(key, USED, tokens)
                    pipe.hset(key, field, tokens)
                    await pipe.execute()
        return AltResult(status, charged, free)


# --- consistency check ---------------------------------------------------------------


def check(r: redis.Redis, key: str) -> list[str]:
    """Problems of a session hash: used must equal the sum of its items, within window."""
    text = {k.decode(): int(v) for k, v in r.hgetall(key).items()}
    if not text:
        return [f"{key}: missing"]
    window, used = text[WINDOW], text[USED]
    held = sum(v for k, v in text.items() if k.startswith(ITEM))
    problems = [f"{key}: used {used} != sum of items {held}"] if used != held else []
    if used > window:
        problems.append(f"{key}: used {used} > window {window}")
    return problems
