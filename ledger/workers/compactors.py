"""Compactors: what turns working-memory items into a summary, off the request path.

A compactor is any callable ``(CompactionRequest) -> CompactionPlan``, or an ``async
def`` one (an LLM summarizer: the worker runs up to ``max_in_flight`` at once), named to
the worker by import path (``module:attribute``). The request carries the text of the
items the agent layer stored in the session's content store (``request.contents``,
keyed ``'<consumer code>:<item id>'``); the plan names the items replaced and the
summary item, with the summary's text (``summary_text``) counted by the same counter
the agent uses. The ledger judges the result: a plan that leaves occupancy above the
high-water mark is a failed compaction.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from ledger import schema
from ledger.errors import ConfigurationError
from ledger.models import Consumer, HeldItem, Item


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactionRequest:
    session_id: str
    epoch: int
    # the turn this compaction prepares: the open turn, or the next one when none is open
    # (a compaction commits between turns); items of earlier turns are its history
    turn: int
    # what the session holds of its committed history, oldest first: an open turn's own
    # items are left out (that turn may yet be rolled back, docs/agent.md#turn-leases)
    items: tuple[HeldItem, ...]
    occupancy: int
    high_water_mark: int
    window: int
    # '<consumer code>:<item id>' -> the item's text, for the items whose text the agent
    # layer stored (worker-owned sessions); items missing here have no stored text
    contents: Mapping[str, str] = field(default_factory=dict)

    def text_of(self, item: HeldItem) -> str | None:
        return self.contents.get(schema.content_field(item.consumer.code, item.id))


@dataclass(frozen=True, slots=True)
class CompactionPlan:
    replaced: tuple[tuple[Consumer, str], ...]
    summary: Item | None
    summary_text: str | None = None  # what the agent puts in its prompt for the summary


Compactor = Callable[[CompactionRequest], CompactionPlan]
AsyncCompactor = Callable[[CompactionRequest], Awaitable[CompactionPlan]]
AnyCompactor = Callable[[CompactionRequest], CompactionPlan | Awaitable[CompactionPlan]]

NO_COMPACTOR = (
    "the worker needs a compactor named explicitly: --compactor module:attr (or "
    "LEDGER_WORKER_COMPACTOR), e.g. a summarizer built with "
    "ledger.adapters.summarizer; 'none' for a fleet whose sessions compact inline "
    "(compaction='agent'); ledger.workers.compactors:simulated only for the demo and tests (it "
    "sees no content and would drop items the agent still has in its prompt)"
)


def simulated(request: CompactionRequest) -> CompactionPlan:
    """A deterministic stand-in for a summarizer, for the demo and the tests.

    It summarizes the session's history: every working-memory item but the two
    newest, and the retrieval chunks and tool results that entered in earlier turns.
    The summary is 10-60% of what it replaces, drawn from a hash of the session,
    turn and items: like a real summarizer it compresses "on average", so some
    compactions miss the high-water mark (a soft post-condition the ledger makes hard).
    """
    wm = [i for i in request.items if i.consumer is Consumer.WORKING_MEMORY]
    old = wm[:-2] + [
        i
        for i in request.items
        if i.consumer is not Consumer.WORKING_MEMORY and i.turn < request.turn
    ]
    if not old:
        return CompactionPlan((), None)
    # Not the epoch: it is Redis's clock at the session's creation, and the same
    # history must compact alike in every run.
    digest = hashlib.blake2b(
        "|".join(
            [request.session_id, str(request.turn)]
            + [schema.content_field(i.consumer.code, i.id) for i in old]
        ).encode(),
        digest_size=4,
    ).digest()
    seed = digest[:2]
    share = 0.10 + 0.50 * (int.from_bytes(seed, "big") / 65535)
    tokens = max(1, int(sum(it.tokens for it in old) * share))
    return CompactionPlan(
        tuple((it.consumer, it.id) for it in old),
        Item(f"summary-t{request.turn}-{digest.hex()}", tokens, 1000),
    )


def load(path: str) -> AnyCompactor:
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
