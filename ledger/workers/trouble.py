"""What kind of Redis trouble an exception is, and how long to wait before trying again.

Pure: no I/O. The worker uses :func:`kind_of` to tell a condition of the deployment
(out of memory, a read-only replica, loading, busy, unreachable, a missing stream)
from a job's own failure and from a bug, and :class:`Backoff` to wait between tries
while the condition lasts.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import redis.exceptions as rex

from ledger.errors import BackendUnavailable, LedgerError, PermissionDenied

# Redis error codes (the reply's first word) -> the kind counted and logged.
_CODES = {
    "OOM": "oom",
    "READONLY": "readonly",
    "LOADING": "loading",
    "BUSY": "busy",
    "MASTERDOWN": "masterdown",
    "TRYAGAIN": "tryagain",
    "CLUSTERDOWN": "clusterdown",
    "MISCONF": "misconf",
    "NOREPLICAS": "noreplicas",
    "NOSCRIPT": "noscript",
    "NOGROUP": "nogroup",
    "NOPERM": "noperm",
    "WRONGTYPE": "wrongtype",
}
_CLASSES: tuple[tuple[type[BaseException], str], ...] = (
    (rex.OutOfMemoryError, "oom"),
    (rex.ReadOnlyError, "readonly"),
    (rex.BusyLoadingError, "loading"),
    (rex.MasterDownError, "masterdown"),
    (rex.ClusterDownError, "clusterdown"),
    (rex.TryAgainError, "tryagain"),
    (rex.NoScriptError, "noscript"),
    (rex.NoPermissionError, "noperm"),
    (rex.AuthenticationError, "noperm"),
    (rex.ConnectionError, "unavailable"),
    (rex.TimeoutError, "unavailable"),
    (rex.ClusterError, "cluster"),
    (rex.RedisClusterException, "cluster"),
)

# Conditions of the deployment, not of one job: a job that meets one has not failed
# (it is not counted towards its dead-lettering) and is tried again after a wait.
TRANSIENT = frozenset(
    {
        "oom",
        "readonly",
        "loading",
        "busy",
        "masterdown",
        "tryagain",
        "clusterdown",
        "misconf",
        "noreplicas",
        "noscript",
        "unavailable",
        "cluster",
    }
)

# Conditions that concern every partition alike: they end a pass (and reach whoever
# called poll_once or sweep directly); the loop counts them and backs off.
WHOLE_PASS = frozenset({"unavailable", "noperm"})


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception and the ones it was raised from, outermost first."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _code(exc: BaseException) -> str | None:
    status = getattr(exc, "status_code", None)
    if isinstance(status, str) and status in _CODES:
        return _CODES[status]
    text = str(exc)
    for prefix in ("", "Redis refused the call: "):
        if text.startswith(prefix):
            word = text[len(prefix) :].split(" ", 1)[0]
            if word in _CODES:
                return _CODES[word]
    return None


def kind_of(exc: BaseException) -> str | None:
    """The kind of a Redis or ledger error, or None for anything else (a bug).

    Kinds: the TRANSIENT ones, ``nogroup`` (a job stream or its consumer group is
    gone), ``noperm`` (refused by an ACL), ``wrongtype``, ``redis`` (another error
    reply), ``ledger`` (a LedgerError: a script's refusal, or one that names no
    Redis condition). The driver's own error, where there is one, says most."""
    chain = list(_chain(exc))
    if any(isinstance(e, PermissionDenied) for e in chain):
        return "noperm"  # (a refusal inside a script too: its reply names no code first)
    for e in chain:
        if isinstance(e, rex.RedisError | rex.RedisClusterException):
            if str(e).startswith("LEDGER_"):
                return "ledger"
            code = _code(e)
            if code is not None:
                return code
            return next((kind for cls, kind in _CLASSES if isinstance(e, cls)), "redis")
    for e in chain:
        code = _code(e)
        if code is not None:
            return code
        if isinstance(e, BackendUnavailable):
            return "unavailable"
    if any(isinstance(e, LedgerError) for e in chain):
        return "ledger"
    return None


class Backoff:
    """Bounded exponential backoff with jitter: initial, 2x, 4x ... up to maximum,
    each wait drawn in [half, all] of its step; reset() starts over."""

    def __init__(
        self, initial: float, maximum: float, rand: Callable[[], float] = random.random
    ) -> None:
        if not 0 < initial <= maximum:
            raise ValueError(f"backoff needs 0 < initial <= maximum, got {initial}, {maximum}")
        self.initial, self.maximum, self._rand = initial, maximum, rand
        self.failures = 0

    def next(self) -> float:
        step = min(self.maximum, self.initial * 2 ** min(self.failures, 62))
        self.failures += 1
        return float(step * (0.5 + 0.5 * self._rand()))

    def reset(self) -> None:
        self.failures = 0
