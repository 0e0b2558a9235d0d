"""What the sync and asyncio faces share: settings, keys, retry policy, call building."""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import socket
import threading
from collections import defaultdict
from collections.abc import Callable, Coroutine, Generator, Iterable, Mapping, Sequence
from types import MethodType
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, Self, TypeVar, overload

from redis.exceptions import NoScriptError
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
from ledger.errors import (
    BackendUnavailable,
    ConfigurationError,
    InvalidArgument,
    LedgerClosed,
    LedgerError,
    NotReplicated,
    PermissionDenied,
    is_transient,
    translate,
)
from ledger.keys import KeySpace, SessionKeys
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
    Price,
    Reconciled,
    Released,
    Reservation,
    ResetDone,
    SessionBudget,
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
from ledger.protocol import Call, Epoch, stamp
from ledger.settings import LedgerSettings

P = ParamSpec("P")
T = TypeVar("T")
R = TypeVar("R")
S = TypeVar("S", bound=Callable[[], Any])


class _OpIds:
    """Op ids: 80 random bits drawn once per process and a counter, in hex. Unique like
    a uuid4 for any realistic fleet, four times cheaper to make, and shorter in the
    outcome journal. A new process id draws new bits, so a fork (from Python or from C,
    as in a pre-forking server) never repeats its parent's ids; processes restored
    from one memory snapshot must call ``new_op_id.reseed()``."""

    def __init__(self) -> None:
        self.reseed()

    def reseed(self) -> None:
        # One tuple, assigned last: a thread never sees a new pid with an old prefix.
        self.state = (os.getpid(), os.urandom(10).hex(), itertools.count())

    def __call__(self) -> str:
        pid, prefix, counter = self.state
        if pid != os.getpid():
            self.reseed()
            pid, prefix, counter = self.state
        return f"{prefix}{next(counter):x}"


new_op_id = _OpIds()

# At most this many calls in one run_many: Redis serves no one else while a batch runs.
MAX_BATCH = 1000


def _op(op_id: str | None) -> str:
    """The caller's op id as given (an empty one is refused later), or a fresh one."""
    return new_op_id() if op_id is None else op_id


def collect(
    calls: Sequence[Call[Any]], raws: Sequence[object], return_exceptions: bool
) -> list[Any]:
    """The results of a batch, in order, from its raw replies (a reply, or the driver's
    error for that call), each read like a single call's. A refusal or error takes its
    call's place when return_exceptions; otherwise the first one is raised, once every
    reply is read (the other calls took effect). A permission refusal or an outage is
    raised whatever return_exceptions: it concerns the deployment, not one call."""
    out: list[Any] = []
    first: LedgerError | None = None
    for call, raw in zip(calls, raws, strict=True):
        try:
            if isinstance(raw, LedgerError):
                raise raw
            if isinstance(raw, BaseException):
                raise translate(raw) from raw
            out.append(call.parse(protocol.decode(raw)))
        except (PermissionDenied, BackendUnavailable):
            raise
        except LedgerError as exc:
            first = first or exc
            out.append(exc)
    if first is not None and not return_exceptions:
        raise first
    return out


def _fenced_on_first(calls: Sequence[Call[Any]]) -> bool:
    """Whether every call after the first names its turn by the first's op id
    (``<epoch>@~<op id>``, :class:`~ledger.models.BegunBy`): then none of them can take
    effect before the first has (the script refuses it, changing nothing)."""
    if not calls[0].args:
        return False
    fence = f"@~{calls[0].args[0]!s}"
    # ('<version>:<epoch>@~<op id>!<owner token>': the token is no op id's character)
    return all(
        len(c.args) > 1 and str(c.args[1]).partition("!")[0].endswith(fence) for c in calls[1:]
    )


def batch_loads(batch: Sequence[Call[Any]]) -> list[str]:
    """The scripts to load inside a batch's transaction, before its calls: those of
    every session that the batch reaches with more than one script. Inside one EXEC
    the script cache cannot change, so all of a script's calls run or none does; a
    session reached by one script keeps its order when only the calls that met NOSCRIPT
    are sent again, and sessions are independent of each other. A session reached by
    several scripts could see a later call run before an earlier one: its scripts are
    loaded first (each SCRIPT LOAD sends the script's text, a few KB), unless its later
    calls are fenced on its first (a begin_turn and its turn's first calls): they cannot
    take effect before it, and are sent again after it (see :func:`batch_replies`)."""
    by_session: dict[str, list[Call[Any]]] = defaultdict(list)
    for c in batch:
        by_session[c.keys[0]].append(c)
    names = {
        c.script
        for calls in by_session.values()
        if len({c.script for c in calls}) > 1 and not _fenced_on_first(calls)
        for c in calls
    }
    return sorted(names)


def batch_replies(
    replies: Sequence[object],
    loaded: int,
    todo: Sequence[int],
    raws: list[object],
    batch: Sequence[Call[Any]],
) -> list[int]:
    """Store the calls' replies (after the `loaded` SCRIPT LOAD replies) in raws, and
    return the indices to send again once their scripts are loaded: those that met
    NOSCRIPT, and every later call of a session one of them reached (calls fenced on it,
    refused while it had not run). A transient error is raised: the whole batch is sent
    again, which its op ids make safe."""
    missing: list[int] = []
    for i, reply in zip(todo, replies[loaded:], strict=True):
        if isinstance(reply, NoScriptError):
            missing.append(i)
        elif isinstance(reply, BaseException) and is_transient(reply):
            raise reply
        raws[i] = reply
    first = {batch[i].keys[0]: i for i in reversed(missing)}
    return [i for i in todo if i in missing or first.get(batch[i].keys[0], len(batch)) < i]


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


class _Runs(Protocol):
    def run(self, call: Call[R], /) -> R: ...


class _AwaitsRun(Protocol):
    def run(self, call: Call[R], /) -> Coroutine[Any, Any, R]: ...


class SyncFace(Protocol):
    """A session whose ledger runs a call and returns its result (:class:`Session`)."""

    @property
    def ledger(self) -> _Runs: ...


class AsyncFace(Protocol):
    """A session whose ledger runs a call as a coroutine (:class:`AsyncSession`)."""

    @property
    def ledger(self) -> _AwaitsRun: ...


class operation(Generic[P, T]):
    """A session operation, defined once by the method that builds its call.

    ``admit = operation(admit_call)`` in :class:`SessionCore` gives every face its
    ``admit``: on a :class:`Session` a method returning the result, on an
    :class:`AsyncSession` a coroutine function; each sends the built call with its
    ledger's ``run``. The face decides how I/O happens, and static types follow it:
    the method takes the builder's parameters and returns ``T`` or a coroutine of
    ``T`` (see the overloads of ``__get__``). ``admit_call`` stays, for ``run_many``.
    """

    def __init__(self, build: Callable[Concatenate[SessionCore, P], Call[T]]) -> None:
        self.build = build
        self.__doc__ = build.__doc__
        self.name = build.__name__.removesuffix("_call")
        self._methods: dict[type, Callable[..., Any]] = {}

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def _method(self, session: Any) -> Callable[..., Any]:
        """The function behind the method, for the session's class: a coroutine
        function when its ledger's ``run`` is one (the asyncio face)."""
        build = self.build

        def call(self: Any, /, *args: Any, **kwargs: Any) -> Any:
            return self.ledger.run(build(self, *args, **kwargs))

        async def coroutine(self: Any, /, *args: Any, **kwargs: Any) -> Any:
            return await self.ledger.run(build(self, *args, **kwargs))

        method = coroutine if inspect.iscoroutinefunction(session.ledger.run) else call
        functools.update_wrapper(method, build)  # its doc, and its signature for inspect
        method.__name__ = self.name
        method.__qualname__ = f"{type(session).__qualname__}.{self.name}"
        return self._methods.setdefault(type(session), method)

    @overload
    def __get__(self, session: None, owner: type[Any] | None = None) -> Self: ...
    @overload
    def __get__(
        self, session: AsyncFace, owner: type[Any] | None = None
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...
    @overload
    def __get__(self, session: SyncFace, owner: type[Any] | None = None) -> Callable[P, T]: ...
    def __get__(self, session: Any, owner: type[Any] | None = None) -> Any:
        if session is None:
            return self
        method = self._methods.get(type(session)) or self._method(session)
        return MethodType(method, session)


def default_owner() -> str:
    """A turn owner that names this process and tells its handles apart:
    '<host>:<pid>:<4 random hex digits>', cut to an id's 128 characters."""
    host = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in socket.gethostname())
    return f"{host or 'host'}"[:110] + f":{os.getpid()}:{os.urandom(2).hex()}"


class SessionCore:
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

    def __init__(
        self,
        keys: SessionKeys,
        epoch: int,
        drift_action: str = "warn",
        *,
        owner: str | None = None,
        lease_ms: int = 30_000,
        owner_token: str | None = None,
    ) -> None:
        self.keys = keys
        self.epoch = epoch
        self.drift_action = drift_action
        self.owner = (
            protocol.check_id(owner, "turn owner") if owner is not None else default_owner()
        )
        self.lease_ms = int(protocol._lease(lease_ms))
        self.turn: int | None = None  # the open turn this handle began (its calls' stamp)
        self._last_left = 0  # the last turn this handle ended or rolled back
        # the owner token of the turns it begins: this handle's secret, or one given to
        # handles that serve as one owner (the same name and token) from several places
        self._token = (
            protocol.new_token() if owner_token is None else protocol.check_token(owner_token)
        )

    def _stamp(self, turn: int | BegunBy | None = None) -> Epoch:
        """ARGV[2]: the epoch, and the turn the call belongs to (``turn``, by default the
        one this handle holds) with this handle's owner token."""
        return stamp(self.epoch, self.turn if turn is None else turn, self._token)

    def _began(
        self, parse: Callable[[protocol.Reply], TurnStarted]
    ) -> Callable[[protocol.Reply], TurnStarted]:
        def began(r: protocol.Reply) -> TurnStarted:
            started = parse(r)
            # (a begin_turn sent again answers its first reply: an older turn is not taken up)
            if started.turn > max(self.turn or 0, self._last_left):
                self.turn = started.turn
            return started

        return began

    def _left(
        self, turn: int, parse: Callable[[protocol.Reply], R]
    ) -> Callable[[protocol.Reply], R]:
        def left(r: protocol.Reply) -> R:
            # The script ran: the turn is over (a parse may still raise, e.g. ContextDrift).
            if self.turn == turn:
                self.turn = None
            self._last_left = max(self._last_left, turn)
            return parse(r)

        return left

    @property
    def id(self) -> str:
        return self.keys.session_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r}, epoch={self.epoch})"

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

    def reset_call(self, reason: str, *, op_id: str | None = None) -> Call[ResetDone]:
        """Hard reset: advance the epoch, drop every item and reservation, keep the budget.

        Fenced by this handle's epoch, so a reset delivered twice applies once. This
        handle takes the new epoch (its turn, if any, ended with the reset); every other
        handle of the session is stale until its ``refresh()``."""
        call = protocol.reset(self.keys, _op(op_id), self.epoch, reason)

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


# --- fail closed, or an opt-in local allowance (docs/ceilings.md#when-redis-cannot-be-reached)


class LocalAllowance:
    """What one process may admit on its own while Redis cannot be reached: opt-in.

    By default a reservation with a cost is refused with ``BackendUnavailable`` when Redis
    does not answer (the ledger fails closed: no ceiling can be checked). A process that
    prefers to keep serving makes one ``LocalAllowance`` and, on ``BackendUnavailable``,
    asks it (:meth:`admit`): it admits a call while the call's worst case fits what is left
    of ``tokens`` (input, output and cached input together) and, with ``price``, of
    ``cents``. What it admitted is never recorded in any scope, and it is never refilled:
    the worst case over a scope's ceiling is ``tokens`` (and ``cents``) per process that
    holds one, for the life of the process. Thread-safe."""

    def __init__(self, *, tokens: int, cents: int | None = None, price: Price | None = None):
        if type(tokens) is not int or tokens < 0:
            raise InvalidArgument(f"tokens must be an int >= 0, got {tokens!r}")
        if (cents is None) != (price is None):
            raise InvalidArgument("a money allowance needs both cents and a price")
        self.tokens, self.cents, self.price = tokens, cents, price
        self._left_tokens = tokens
        self._left_money = None if cents is None else cents * 1_000_000
        self._lock = threading.Lock()
        self.admitted = 0

    def admit(self, cost: CallCost) -> bool:
        """Take the call's worst case from what is left, or refuse it (False)."""
        tok = cost.input + cost.output + cost.cached_input
        money = 0
        if self.price is not None:
            p = self.price
            money = (
                cost.input * p.input + cost.output * p.output + cost.cached_input * p.cached_input
            )
        with self._lock:
            if tok > self._left_tokens or (
                self._left_money is not None and money > self._left_money
            ):
                return False
            self._left_tokens -= tok
            if self._left_money is not None:
                self._left_money -= money
            self.admitted += 1
            return True

    @property
    def left(self) -> tuple[int, int | None]:
        """Tokens and micro-cents left."""
        return self._left_tokens, self._left_money
