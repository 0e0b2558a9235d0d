"""What the sync and asyncio faces share: ``LedgerCore`` (settings, key space, the checks
of a call before it is sent, the retry policy). The rest of what they share has a module
of its own, each re-exported here: ``session_calls`` (``SessionCore``, every operation's
call builder), ``operations`` (``operation``), ``handles`` (a session handle, op ids),
``batches`` (``run_many``'s batches), ``allowance`` (``LocalAllowance``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Generator, Iterable
from typing import Any, Self, TypeVar

from tenacity import (
    DoAttempt,
    DoSleep,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from ledger import protocol
from ledger.allowance import LocalAllowance
from ledger.batches import MAX_BATCH, batch_loads, batch_replies, collect
from ledger.errors import (
    ConfigurationError,
    InvalidArgument,
    LedgerClosed,
    NotReplicated,
    is_transient,
    translate,
)
from ledger.handles import _op, default_owner, new_op_id
from ledger.keys import KeySpace
from ledger.models import SessionBudget
from ledger.operations import AsyncFace, SyncFace, operation
from ledger.protocol import Call
from ledger.session_calls import SessionCore
from ledger.settings import LedgerSettings

__all__ = [
    "MAX_BATCH",
    "AsyncFace",
    "LedgerCore",
    "LocalAllowance",
    "SessionCore",
    "SyncFace",
    "batch_loads",
    "batch_replies",
    "collect",
    "default_owner",
    "new_op_id",
    "operation",
]

S = TypeVar("S", bound=Callable[[], Any])


class LedgerCore:
    """Settings and key space of one ledger client, and its retry policy."""

    def __init__(self, settings: LedgerSettings) -> None:
        self.settings = settings
        self.keyspace = KeySpace(settings.prefix, settings.partitions)
        self.closed = False
        self._owned: set[str] = set()  # session keys checked to be of this key space

    def check_acked(self, call: Call[Any], acked: object) -> None:
        """After a durable write: WAIT's answer, the replicas that hold it; fewer than
        ``replica_acks`` raises :class:`NotReplicated`."""
        wanted = self.settings.replica_acks
        if isinstance(acked, Exception):
            raise acked
        got = int(acked)  # type: ignore[call-overload]
        if got < wanted:
            raise NotReplicated(
                f"{call.script} was applied on the primary but held by {got} of "
                f"{wanted} replicas after {self.settings.replica_ack_timeout_ms} ms: a "
                "failover now may lose it; send the same call again (same op id) to wait "
                "again",
                acked=got,
                wanted=wanted,
            )

    def check_open(self) -> None:
        if self.closed:
            raise LedgerClosed(
                "this ledger was closed; make a new one (e.g. Ledger.from_settings(settings))"
            )

    def check_call(self, call: object) -> Call[Any]:
        """The call, if this ledger may send it: a :class:`Call` whose session key is of
        this ledger's key space (its prefix, and the partition its session id maps to). A
        call built by a ledger of another prefix or partition count is refused: sent
        here, it would read or change another tenant's session, or a session that
        nothing else finds."""
        self.check_open()
        if not isinstance(call, Call):
            raise InvalidArgument(f"expected a ledger Call, got {type(call).__name__}")
        key = call.keys[0] if call.keys else ""
        if key not in self._owned:
            if not (self.keyspace.owns(key) or self.keyspace.owns_scope(key)):
                raise InvalidArgument(
                    f"the call's key {key!r} is not a session of this ledger (prefix "
                    f"{self.keyspace.prefix!r}, {self.keyspace.partitions} partitions): build "
                    "calls with a session of the ledger that sends them"
                )
            if len(self._owned) >= 10_000:
                self._owned.clear()
            self._owned.add(key)
        return call

    def check_batch(self, calls: Iterable[Call[Any]]) -> list[Call[Any]]:
        batch = list(calls)
        if len(batch) > MAX_BATCH:
            raise InvalidArgument(f"run_many takes at most {MAX_BATCH} calls, got {len(batch)}")
        for call in batch:
            self.check_call(call)
        return batch

    @classmethod
    def from_settings(cls, settings: LedgerSettings) -> Self:
        raise NotImplementedError

    @classmethod
    def from_url(cls, url: str | None = None, **overrides: Any) -> Self:
        """``Ledger.from_url("redis://localhost:6379/0")``; ``None`` reads
        ``LEDGER_REDIS_URL`` (no default: :class:`ConfigurationError` when it is unset;
        ``"embedded://"`` asks for the in-process backend); other settings as keywords."""
        if url is not None:
            overrides["redis_url"] = url
        return cls.from_settings(LedgerSettings(**overrides))

    def retries(self, exc: BaseException) -> bool:
        """Whether a failed first try is worth more tries (transient, and tries are left)."""
        return is_transient(exc) and self.settings.retry_attempts > 1

    def retry_policy(self) -> dict[str, Any]:
        """tenacity arguments: bounded tries with jittered exponential backoff, only on
        transient driver errors; safe because every mutating call carries its op id."""
        s = self.settings
        return {
            "stop": stop_after_attempt(s.retry_attempts - 1)
            | stop_after_delay(s.retry_max_seconds),
            "wait": wait_random_exponential(
                multiplier=s.retry_initial_backoff, max=s.retry_max_backoff
            ),
            "retry": retry_if_exception(is_transient),
            "reraise": True,
        }

    def retried(self, first: Exception, send: S) -> Generator[S | float, Any, Any]:
        """What follows a failed first try of ``send`` (one call, or one batch): the one
        body of the retry policy, whatever the I/O. It yields ``send`` for each further
        try (the face makes it, then sends its reply back or throws its error in) or the
        seconds to wait before one (the face sleeps); it returns the reply. Only
        transient failures are tried again, within ``retry_policy``; the error that ends
        the tries is raised translated. The first try, made by the face, costs no retry
        machinery."""
        try:
            if not self.retries(first):
                raise first
            retrying = Retrying(**self.retry_policy())
            retrying.begin()
            state = RetryCallState(retrying, None, (), {})
            while True:
                do = retrying.iter(state)
                if isinstance(do, DoAttempt):
                    try:
                        state.set_result((yield send))
                    except Exception as exc:
                        state.set_exception((type(exc), exc, exc.__traceback__))
                elif isinstance(do, DoSleep):
                    state.prepare_for_next_attempt()
                    yield float(do)
                else:
                    return do
        except Exception as exc:
            raise translate(exc) from exc

    def open_call(self, session_id: str, budget: SessionBudget, op_id: str | None) -> Call[Any]:
        if not isinstance(budget, SessionBudget):
            raise ConfigurationError(f"budget must be a SessionBudget, got {type(budget).__name__}")
        return protocol.open_session(
            self.keyspace.session(session_id),
            _op(op_id),
            budget,
            self.settings.op_retention_seconds * 1000,
        )

    @staticmethod
    def plan_expiry(members: Iterable[Any]) -> dict[str, list[str]]:
        """Group due deadline-index members '<session>|<reservation>' by session."""
        out: dict[str, list[str]] = defaultdict(list)
        for m in members:
            text = m.decode() if isinstance(m, bytes) else m
            sid, _, rid = text.rpartition("|")
            out[sid].append(rid)
        return out
