"""Compactors: what turns working-memory items into a summary, off the request path.

A compactor is any callable ``(CompactionRequest) -> CompactionPlan``, named to the
worker by import path (``module:attribute``). The ledger judges its result: a plan
that leaves occupancy above the high-water mark is a failed compaction (record 001).
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from ledger.errors import ConfigurationError
from ledger.models import HeldItem, Item


@dataclass(frozen=True, slots=True)
class CompactionRequest:
    session_id: str
    epoch: int
    turn: int
    working_memory: tuple[HeldItem, ...]  # oldest first
    occupancy: int
    high_water_mark: int
    window: int


@dataclass(frozen=True, slots=True)
class CompactionPlan:
    replaced: tuple[str, ...]
    summary: Item | None


Compactor = Callable[[CompactionRequest], CompactionPlan]


def simulated(request: CompactionRequest) -> CompactionPlan:
    """A deterministic stand-in for a summarizer, for the demo and the tests.

    It replaces every working-memory item but the two newest with one summary whose
    size is 10-60% of what it replaces, drawn from a hash of the session, epoch and
    turn: like a real summarizer, it compresses "on average", so some compactions
    miss the high-water mark (a soft post-condition the ledger makes hard).
    """
    old = request.working_memory[:-2]
    if not old:
        return CompactionPlan((), None)
    seed = hashlib.blake2b(
        f"{request.session_id}|{request.epoch}|{request.turn}".encode(), digest_size=2
    ).digest()
    share = 0.10 + 0.50 * (int.from_bytes(seed, "big") / 65535)
    tokens = max(1, int(sum(it.tokens for it in old) * share))
    return CompactionPlan(
        tuple(it.id for it in old), Item(f"summary-e{request.epoch}-t{request.turn}", tokens, 1000)
    )


def load(path: str) -> Compactor:
    """Import a compactor named 'package.module:attribute'."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ConfigurationError(f"compactor must be 'module:attribute', got {path!r}")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"cannot import compactor {path!r}: {exc}") from exc
    if not callable(found):
        raise ConfigurationError(f"compactor {path!r} is not callable")
    return found  # type: ignore[no-any-return]
