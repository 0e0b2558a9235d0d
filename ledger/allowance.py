"""Fail closed, or an opt-in local allowance (docs/ceilings.md#when-redis-cannot-be-reached)."""

from __future__ import annotations

import threading

from ledger.errors import InvalidArgument
from ledger.models import CallCost, Price


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
