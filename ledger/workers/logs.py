"""What the worker says: its JSON log lines (``JsonFormatter``), the URL it names
(``mask_url``), and the Redis trouble it survives (``Troubles``: counted by kind in
``ledger_worker_errors``, logged at most every 10 s per kind)."""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from ledger.workers.trouble import WHOLE_PASS, kind_of

if TYPE_CHECKING:  # (metrics.py imports describe from here)
    from ledger.workers.metrics import Metrics

log = logging.getLogger("ledger.worker")

# What the worker says when it meets each kind of Redis trouble (the log line's msg).
MESSAGES = {
    "oom": "Redis is out of memory (OOM: used memory is above maxmemory) and refuses "
    "writes: jobs wait and are retried with backoff; free memory or raise maxmemory "
    "(keep maxmemory-policy noeviction)",
    "readonly": "Redis refused a write (READONLY: the server is a replica, e.g. after a "
    "failover): retrying with backoff",
    "loading": "Redis is loading its dataset (LOADING): retrying with backoff",
    "busy": "Redis is busy running a script (BUSY): retrying with backoff",
    "masterdown": "Redis replica lost its primary (MASTERDOWN): retrying with backoff",
    "clusterdown": "Redis Cluster is down (CLUSTERDOWN): retrying with backoff",
    "tryagain": "Redis Cluster slot is moving (TRYAGAIN): retrying with backoff",
    "cluster": "Redis Cluster error: retrying with backoff",
    "misconf": "Redis refuses writes because it cannot persist (MISCONF): retrying with backoff",
    "noreplicas": "Redis refuses writes: not enough replicas (NOREPLICAS): retrying with backoff",
    "noscript": "Redis lost the ledger's scripts (NOSCRIPT): retrying with backoff",
    "unavailable": "Redis unavailable: retrying with backoff",
    "noperm": "Redis refused a command (ACL, NOPERM): check the worker's ACL user",
    "wrongtype": "a ledger key holds the wrong type (WRONGTYPE): something else wrote to it",
    "redis": "Redis error: retrying with backoff",
    "ledger": "ledger error: retrying with backoff",
}


class Troubles:
    """The errors a worker survives, met by any of its parts: each counted, logged by
    kind, and remembered for the loop (``troubled``: back off before the next pass;
    ``last_kind``: whether Redis still answered)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        # .job: this thread is one of delivery's job threads (set by the thread itself)
        self.job_threads = threading.local()
        self.troubled = False  # this pass met a Redis error: back off before the next
        self.last_kind: str | None = None
        self._said: dict[str, float] = {}  # kind -> when it was last logged
        self._unsaid: dict[str, int] = {}  # kind -> occurrences not logged since

    def met(self, kind: str, exc: BaseException, **where: object) -> None:
        """Count a Redis error the worker survives; log it (each kind at most every 10 s,
        with the number of occurrences not logged in between). Met by the job loop (not
        by a job thread, which leaves its job pending), it makes the loop back off."""
        if not self.in_job_thread():
            self.troubled = True
        self.metrics.errors.labels(kind).inc()
        now = time.monotonic()
        if now - self._said.get(kind, float("-inf")) < 10:
            self._unsaid[kind] = self._unsaid.get(kind, 0) + 1
            return
        self._said[kind] = now
        log.warning(
            MESSAGES.get(kind, MESSAGES["redis"]),
            extra={
                "kind": kind,
                "error": describe(exc),
                "not_logged_since": self._unsaid.pop(kind, 0),
                **where,
            },
        )

    def in_job_thread(self) -> bool:
        """A job thread's trouble leaves its job pending; it does not make the loop back
        off."""
        return bool(getattr(self.job_threads, "job", False))

    def redis_ok_despite_trouble(self) -> bool:
        """After a troubled pass: whether Redis still answered (the trouble was a job's
        or a bug's, not an outage or a refusal)."""
        return self.last_kind not in WHOLE_PASS

    def survive(self, exc: BaseException, where: str) -> None:
        """Whatever escaped a step of the loop: a Redis or ledger error is counted and
        logged by kind, anything else (a bug) logged with its traceback, as internal."""
        kind = kind_of(exc)
        self.last_kind = kind
        if kind is None:
            self.troubled = True
            self.metrics.errors.labels("internal").inc()
            log.error(
                "unexpected error in the worker loop (a bug?); going on after a backoff",
                extra={"where": where, "kind": "internal", "error": describe(exc)},
                exc_info=exc,
            )
        else:
            self.met(kind, exc, where=where)

    def guard(self, step: Callable[[], object], where: str) -> object:
        """step(), with whatever escapes it counted and logged (see survive)."""
        try:
            return step()
        except Exception as exc:
            self.survive(exc, where)
            return None


def mask_url(url: str) -> str:
    """The URL with its password (if any) replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def describe(exc: BaseException) -> str:
    """'Type: message' (redis-py's repr of its errors omits the message)."""
    return f"{type(exc).__name__}: {exc}"[:500]


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, message and any extra fields."""

    _skip = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message"}

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        data = {
            "ts": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "msg": record.getMessage(),
        }
        data.update({k: v for k, v in record.__dict__.items() if k not in self._skip})
        if record.exc_info:
            data["traceback"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)
