"""``operation``: a session operation defined once, by the method that builds its call,
and given to every face (a method on ``Session``, a coroutine function on ``AsyncSession``)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine
from types import MethodType
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Generic,
    ParamSpec,
    Protocol,
    Self,
    TypeVar,
    overload,
)

from ledger.protocol import Call

if TYPE_CHECKING:
    from ledger.session_calls import SessionCore


P = ParamSpec("P")
T = TypeVar("T")
R = TypeVar("R")


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
