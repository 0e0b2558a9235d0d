"""A session handle (``SessionHandle``, the base of ``SessionCore``): its keys, epoch, turn
owner and owner token, the turn it holds; and the ids a client makes for itself: op ids,
and the default owner of a turn. No I/O."""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Callable
from typing import TypeVar

from ledger import protocol
from ledger.keys import SessionKeys
from ledger.models import BegunBy, TurnStarted
from ledger.protocol import Epoch, stamp

R = TypeVar("R")


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


def _op(op_id: str | None) -> str:
    """The caller's op id as given (an empty one is refused later), or a fresh one."""
    return new_op_id() if op_id is None else op_id


def default_owner() -> str:
    """A turn owner that names this process and tells its handles apart:
    '<host>:<pid>:<4 random hex digits>', cut to an id's 128 characters."""
    host = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in socket.gethostname())
    return f"{host or 'host'}"[:110] + f":{os.getpid()}:{os.urandom(2).hex()}"


class SessionHandle:
    """One session's identity and epoch, the owner of the turns it begins and the turn it
    holds: what stamps the calls of :class:`~ledger.session_calls.SessionCore`."""

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
            self._adopt_reset(r)  # (before the parse, which raises on a refusal)
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
            self._adopt_reset(r)
            return parse(r)

        return left

    def _adopt_reset(self, r: protocol.Reply) -> None:
        """A staged hard reset applied with the call (reset=<new epoch>,
        docs/rules.md#a-reset-waits-for-the-turns-end): this handle takes the new epoch."""
        got = r.get("reset")
        if got and int(got) > self.epoch:  # (a call sent again answers its first reply)
            self.epoch = int(got)

    @property
    def id(self) -> str:
        return self.keys.session_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r}, epoch={self.epoch})"
