"""One exception tree for everything the ledger raises.

Every error a caller can see derives from :class:`LedgerError`. Errors raised by
the Lua scripts arrive as ``LEDGER_<CODE> message`` and are mapped to a class here,
in one place (:func:`translate`), together with the driver's own errors.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Final, Literal, get_args

import redis.exceptions as rex


class LedgerError(Exception):
    """Root of every error raised by this package."""


class ConfigurationError(LedgerError, ValueError):
    """A budget or setting that cannot work, e.g. a reserved floor larger than the window."""


class InvalidArgument(LedgerError, ValueError):
    """An argument was malformed (bad id, negative or non-integer tokens, unknown consumer)."""


class LedgerClosed(LedgerError, RuntimeError):
    """The ledger's connection was closed with ``close()``; make a new ledger to go on."""


class UnknownSession(LedgerError, LookupError):
    """The session was never opened, was closed, or expired."""


class SessionConflict(LedgerError):
    """The session exists with another budget, or a reservation/item id is taken."""


class StaleEpoch(LedgerError):
    """The call was stamped with an epoch older than the session's (a hard reset happened)."""


class OperationIdReused(LedgerError):
    """An operation id was used again with different arguments."""


class UnknownReservation(LedgerError, LookupError):
    """The reservation is not open: settled, voided, expired and swept, or never made."""


class UnknownScope(LedgerError, LookupError):
    """A budget scope named in a call has no ceilings set (``set_scope`` was never called
    for it): nothing was held or changed (docs/ceilings.md)."""


class ReservationExpired(LedgerError):
    """The reservation's deadline passed on Redis's clock; it can no longer be settled."""


class TurnConflict(LedgerError):
    """A call collided with the session's turn lease (docs/agent.md#turn-leases): one
    process at a time serves a session's turn. ``turn`` is the turn concerned."""

    turn: int | None = None


class TurnInProgress(TurnConflict):
    """Another owner's turn is open: ``begin_turn`` (without ``takeover``) and every call
    of no turn are refused, nothing changed. ``owner`` holds turn ``turn`` for
    ``lease_left_ms`` more milliseconds (negative once its lease lapsed: the next
    ``begin_turn`` or the worker rolls it back). Wait for it, or take it over."""

    _RE = re.compile(r"turn (\d+) is held by (\S+) \(lease (-?\d+) ms left\)")

    def __init__(self, message: str) -> None:
        super().__init__(message)
        m = self._RE.search(message)
        self.turn = int(m.group(1)) if m else None
        self.owner: str | None = m.group(2) if m else None
        self.lease_left_ms: int | None = int(m.group(3)) if m else None


class TurnLost(TurnConflict):
    """The call's turn is not open any more: it ended, another owner took it over, or it
    was rolled back because its lease lapsed (docs/agent.md#a-dead-turn-is-undone).
    Nothing changed; what the turn did is undone (or committed, if it ended). ``turn``:
    the call's turn; ``rolled_back``: whether it was rolled back."""

    _RE = re.compile(r"turn (\d+) is not open")

    def __init__(self, message: str) -> None:
        super().__init__(message)
        m = self._RE.search(message)
        self.turn = int(m.group(1)) if m else None
        self.rolled_back = "rolled back" in message


class CompactionPending(TurnConflict):
    """``begin_turn`` asked to wait for a pending compaction (the agent layer does, on a
    worker-owned session, while ``await_compaction`` allows): the turn did not begin and
    nothing changed. ``computing``: a worker (``worker``) is computing it now, until
    ``until_ms`` (Redis's clock); else none has picked it up yet, and ``requested_ms_ago``
    says how long ago its job was requested (``None`` when the session does not say). Begin
    again later, or without waiting."""

    _RE = re.compile(r"computed by (\S+) until (\d+)")
    _ASKED = re.compile(r"requested (\d+) ms ago")

    def __init__(self, message: str) -> None:
        super().__init__(message)
        m = self._RE.search(message)
        self.computing = m is not None
        self.worker: str | None = m.group(1) if m else None
        self.until_ms: int | None = int(m.group(2)) if m else None
        asked = self._ASKED.search(message)
        self.requested_ms_ago: int | None = int(asked.group(1)) if asked else None


class VersionMismatch(LedgerError):
    """A call, or a session, of another version than the scripts' (docs/protocol.md#versions):
    refused before anything was written. ``kind``: ``"protocol"`` (the call's version,
    ``found``, is not the scripts' ``expected``; a client of protocol 1 sends none and
    ``found`` is 1) or ``"layout"`` (the session's stored layout ``found`` is one the
    scripts of protocol ``expected`` do not read). Run clients, workers and scripts of one
    version, or follow the upgrade runbook (docs/operations.md#upgrades)."""

    _FOUND = re.compile(r"is of (protocol|layout) (\d+)")
    _EXPECTED = re.compile(r"these scripts are of protocol (\d+)")

    def __init__(self, message: str) -> None:
        super().__init__(message)
        m, e = self._FOUND.search(message), self._EXPECTED.search(message)
        self.kind: str | None = m.group(1) if m else None
        self.found: int | None = int(m.group(2)) if m else None
        self.expected: int | None = int(e.group(1)) if e else None


class PermissionDenied(LedgerError, PermissionError):
    """Redis refused the credentials (AUTH) or a command or key (ACL, NOPERM)."""


class BackendUnavailable(LedgerError, ConnectionError):
    """Redis could not be reached, or did not answer, after the bounded retries."""


class NotReplicated(BackendUnavailable):
    """A write the primary applied was not held by ``replica_acks`` replicas within
    ``replica_ack_timeout_ms`` (``LedgerSettings``): a failover now may lose it. Its op
    id is stored with it, so sending the same call again is safe: it gets the same
    outcome back and waits for the replicas again."""

    def __init__(self, message: str, *, acked: int, wanted: int) -> None:
        super().__init__(message)
        self.acked = acked
        self.wanted = wanted


RefusalReason = Literal[
    "token_budget_exhausted",
    "floor_protected",
    "compaction_pending",
    "starvation",
    "fanout_guard",
    "ceiling_reached",
    "child_floor",
    "not_whole",
]
REFUSAL_REASONS: Final[frozenset[str]] = frozenset(get_args(RefusalReason))
PendingBound = Literal["pending", "failed"]


class AdmissionRefused(LedgerError):
    """The ledger refused an admission; nothing was allocated.

    ``reason`` is one of the documented reason codes (:data:`RefusalReason`),
    ``requested`` the tokens asked for and ``free`` the tokens that were free. For
    ``compaction_pending`` refusals of memory, ``bound`` says which bound of the
    compaction-credit rule (docs/rules.md#compaction-credit) refused it:
    ``"pending"`` (the post-compaction baseline, high-water mark plus the
    memory admitted since the compaction became pending, plus the request and the
    output reserve, would pass the window) or ``"failed"`` (the last compaction failed:
    no memory until one succeeds); ``baseline`` is that baseline in tokens. ``None``
    for every other refusal.
    """

    def __init__(self, reason: str, requested: int, free: int, detail: Mapping[str, str]) -> None:
        if reason not in REFUSAL_REASONS:
            raise ValueError(f"undocumented refusal reason {reason!r}")
        self.reason: RefusalReason = reason  # type: ignore[assignment]
        self.requested = requested
        self.free = free
        self.detail = dict(detail)
        bound = detail.get("bound")
        self.bound: PendingBound | None = bound if bound in ("pending", "failed") else None  # type: ignore[assignment]
        self.baseline: int | None = int(detail["baseline"]) if "baseline" in detail else None
        super().__init__(f"{reason}: requested {requested} tokens, {free} free")


class WorkingMemoryStarvation(AdmissionRefused):
    """The turn cannot start: residual working memory is below its working set even
    after reclaiming scratchpad and stale retrieval (docs/rules.md#working-memory-starvation).
    A working-memory compaction has been requested; ``compact`` lists the items to compact first."""

    def __init__(self, detail: Mapping[str, str]) -> None:
        super().__init__(detail["reason"], int(detail["requested"]), int(detail["free"]), detail)
        self.residual = int(detail["residual"])
        self.requirement = int(detail["need"])
        self.utilization = int(detail["utilization"]) / 1000
        self.shortfall = int(detail["shortfall"])
        self.compact = tuple(i.split(":", 1)[1] for i in detail["compact"].split(",") if i)
        Exception.__init__(
            self,
            f"{self.reason}: residual working memory {self.residual} < required "
            f"{self.requirement} at utilization {self.utilization:.2f}; reclamation "
            f"insufficient, compact {len(self.compact)} working-memory item(s)",
        )


class FanoutRefused(AdmissionRefused):
    """The turn's amplification passed the pathological threshold
    (docs/rules.md#amplification):
    summarize and proceed instead of another memory-tool call."""

    def __init__(self, detail: Mapping[str, str]) -> None:
        super().__init__("fanout_guard", int(detail["requested"]), int(detail["free"]), detail)
        self.ratio = int(detail["ratio"]) / 1000
        self.threshold = int(detail["threshold"]) / 1000
        Exception.__init__(
            self,
            f"fanout_guard: amplification {self.ratio:.2f} > {self.threshold:.2f}; "
            "summarize and proceed before the next fan-out",
        )


class CeilingReached(AdmissionRefused):
    """A budget scope above the session (a tenant, or a key or user within it) would pass
    one of its ceilings: the reservation was refused, nothing held in the session or in
    any scope (docs/ceilings.md). ``scope`` names it, ``quantity`` the ceiling (input,
    output, cached_input, tokens or money), ``ceiling`` its value; ``requested`` and
    ``free`` are in that quantity's unit (money: micro-cents, a millionth of a cent)."""

    def __init__(self, detail: Mapping[str, str]) -> None:
        super().__init__(detail["reason"], int(detail["requested"]), int(detail["free"]), detail)
        self.scope = detail["scope"]
        self.quantity = detail["quantity"]
        self.ceiling = int(detail["ceiling"])
        Exception.__init__(
            self,
            f"ceiling_reached: scope {self.scope} {self.quantity} ceiling {self.ceiling}: "
            f"requested {self.requested}, {self.free} left",
        )


class ContextDrift(LedgerError):
    """The real prompt does not match the ledger: at ``end_turn`` it differed from
    occupancy by more than the session's ``framing_tolerance``, or it was larger than
    the window. The turn has ended and the drift is recorded (``snapshot``, ``audit``);
    ``report`` is the turn's :class:`~ledger.models.TurnReport`. Raised when the
    setting ``drift_action`` is ``raise``; otherwise :class:`ContextDriftWarning`."""

    def __init__(self, report: object, message: str) -> None:
        self.report = report
        super().__init__(message)


class ContextOverflow(LedgerError):
    """A prompt about to be sent to the model is larger than the window minus the output
    reserve; the adapters refuse it before the call (``prompt``, ``limit``)."""

    def __init__(self, prompt: int, limit: int) -> None:
        self.prompt = prompt
        self.limit = limit
        super().__init__(
            f"the prompt about to be sent is {prompt} tokens, over the {limit} tokens the "
            "window leaves after the output reserve: refused before the model call"
        )


class DamagedSession(LedgerError):
    """A session's stored state cannot be read: a field that holds a number holds
    something else (``field``, ``value``). Written by hand or by something other than the
    ledger's scripts; ``ledger audit`` and ``ledger inspect`` say so, and nothing reads
    it as if it were whole."""

    def __init__(self, field: str, value: str) -> None:
        self.field = field
        self.value = value
        super().__init__(
            f"the session's field {field!r} holds {value[:40]!r}, not a number: its stored "
            "state is damaged (written by something other than the ledger's scripts)"
        )


class BillingDriftWarning(UserWarning):
    """What the provider billed for a prompt differs from the ledger's count of it beyond
    the agent's ``billing_tolerance`` (``check``: a :class:`~ledger.agent.BillingCheck`):
    the local counter is off (it is then calibrated, when it estimates), or the report
    covers what the count did not (a system message or tool schemas the adapter never
    saw: then nothing is learned)."""

    def __init__(self, check: object, message: str) -> None:
        self.check = check
        super().__init__(message)


class ContextDriftWarning(UserWarning):
    """The warning form of :class:`ContextDrift` (setting ``drift_action="warn"``)."""

    def __init__(self, report: object, message: str) -> None:
        self.report = report
        super().__init__(message)


class LostWriteWarning(UserWarning):
    """A framework adapter's turn starts without state written between turns: the write
    (``graph.update_state``) went on top of a checkpoint of a turn that was rolled back
    (a dead branch), not on the committed state (``checkpoints``: the writes' ids)."""

    def __init__(self, checkpoints: list[str], message: str) -> None:
        self.checkpoints = checkpoints
        super().__init__(message)


_CODES: Final[dict[str, type[LedgerError]]] = {
    "BADARG": InvalidArgument,
    "CONFIG": ConfigurationError,
    "NOSESSION": UnknownSession,
    "CONFLICT": SessionConflict,
    "STALE": StaleEpoch,
    "OPREUSED": OperationIdReused,
    "NORESERVATION": UnknownReservation,
    "NOSCOPE": UnknownScope,
    "EXPIRED": ReservationExpired,
    "TURNHELD": TurnInProgress,
    "TURNLOST": TurnLost,
    "COMPACTING": CompactionPending,
    "VERSION": VersionMismatch,
}

_UNAVAILABLE = (
    rex.ConnectionError,
    rex.TimeoutError,
    rex.BusyLoadingError,
    rex.TryAgainError,
    rex.ClusterDownError,
    rex.MasterDownError,
    rex.ClusterError,  # e.g. 'TTL exhausted' while a slot is split during a migration
)
# Worth another try, but not an outage: a SCRIPT FLUSH between redis-py's reload and
# its second EVALSHA (the next try loads the script again).
_RETRYABLE = (*_UNAVAILABLE, rex.NoScriptError)
# Never retried: a wrong password or an ACL refusal will not change by trying again.
_DENIED = (rex.AuthenticationError, rex.AuthenticationWrongNumberOfArgsError, rex.NoPermissionError)


def _denied(exc: BaseException) -> bool:
    if isinstance(exc, _DENIED):
        return True
    # Inside a script Redis 7 reports an ACL refusal as a plain error: "... no permissions
    # to access ..." for a key, "The user executing the script can't run this command or
    # subcommand" for a command its redis.call() sent.
    text = str(exc).lower()
    return isinstance(exc, rex.ResponseError) and any(w in text for w in _DENIAL_WORDS)


_DENIAL_WORDS = ("no permissions", "noperm", "user executing the script can't run")


def is_transient(exc: BaseException) -> bool:
    """True for driver errors worth retrying: the operation id makes a retry safe."""
    return isinstance(exc, _RETRYABLE) and not _denied(exc)


def translate(exc: BaseException) -> BaseException:
    """Map a driver error to the ledger's tree (call as ``raise translate(e) from e``)."""
    if isinstance(exc, LedgerError):
        return exc
    if _denied(exc):
        return PermissionDenied(f"NOPERM: Redis refused the credentials or command: {exc}")
    if isinstance(exc, _RETRYABLE):
        return BackendUnavailable(f"Redis unavailable: {exc}")
    if isinstance(exc, rex.ResponseError):
        text = str(exc)
        if text.startswith("LEDGER_"):
            code, _, message = text[len("LEDGER_") :].partition(" ")
            # Redis 7 appends " script: <sha>, on @user_script:<line>." to script errors.
            message = message.split(" script: ", 1)[0]
            return _CODES.get(code, LedgerError)(message)
        return LedgerError(f"Redis refused the call: {text}")
    if isinstance(exc, rex.RedisError | rex.RedisClusterException):
        # any other driver error (a misrouted cluster command, a value it cannot encode)
        return LedgerError(f"Redis client error: {type(exc).__name__}: {exc}")
    return exc


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Run plain driver calls (reads outside the scripts) under the same error mapping."""
    try:
        yield
    except Exception as exc:
        mapped = translate(exc)
        if mapped is exc:
            raise
        raise mapped from exc
