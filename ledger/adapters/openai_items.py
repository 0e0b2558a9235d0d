"""The OpenAI Agents adapter's input items as the ledger sees them (no I/O, no SDK
import): each item's text, consumer and ledger id, and the usage an SDK response
reports billed. :mod:`ledger.adapters.openai_agents` re-exports every public name."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ledger.agent.core import ledger_id
from ledger.errors import InvalidArgument
from ledger.models import Consumer, Usage

Entry = Mapping[str, Any]
_DOC = re.compile(r"<document id=\"([^\"]+)\">")


def item_text(item: Entry) -> str:
    """The text a model is sent of one input item."""
    parts: list[str] = []
    for key in ("content", "output"):
        v = item.get(key)
        if isinstance(v, str):
            parts.append(v)
        elif isinstance(v, list):
            parts += [p.get("text", "") for p in v if isinstance(p, Mapping)]
    if item.get("type") == "function_call":
        parts.append(f"{item.get('name', '')}({item.get('arguments', '')})")
    return "\n".join(parts)


def item_consumer(item: Entry) -> Consumer:
    if item.get("type") == "function_call_output":
        return Consumer.SCRATCHPAD
    if isinstance(item.get("content"), str) and _DOC.match(item["content"]):
        return Consumer.RETRIEVAL
    return Consumer.WORKING_MEMORY


@dataclass(frozen=True, slots=True)
class Piece:
    """One input item as the ledger sees it: its consumer, ledger id and text."""

    consumer: Consumer
    id: str
    content: str
    item: dict[str, Any]

    @property
    def key(self) -> tuple[Consumer, str]:
        return (self.consumer, self.id)


def pieces(items: Sequence[Any]) -> list[Piece]:
    """Each item with its consumer and ledger id: a call id, a document id, an item id,
    or (a user message has none) a digest of its role and text with its occurrence."""
    seen: dict[str, int] = {}
    out = []
    for raw in items:
        if not isinstance(raw, Mapping):
            raise InvalidArgument(f"an input item must be a mapping, got {type(raw).__name__}")
        it = dict(raw)
        c = item_consumer(it)
        m = _DOC.match(it["content"]) if c is Consumer.RETRIEVAL else None
        if m is not None:
            app: object = m.group(1)
        elif it.get("call_id"):
            app = it["call_id"]
        elif it.get("id"):
            app = it["id"]
        else:
            text = f"{it.get('role', '')}\x1f{item_text(it)}"
            base = "m." + hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
            seen[base] = seen.get(base, 0) + 1
            app = f"{base}.{seen[base]}"
        out.append(Piece(c, ledger_id(app), item_text(it), it))
    return out


def sdk_usage(usage: Any) -> Usage | None:
    """What an SDK response reports billed (its input tokens count the cached reads too),
    as the ledger settles it; None when it reports no request."""
    i, o = getattr(usage, "input_tokens", None), getattr(usage, "output_tokens", None)
    if type(i) is not int or type(o) is not int or i < 0 or o < 0 or i + o == 0:
        return None
    read = getattr(getattr(usage, "input_tokens_details", None), "cached_tokens", 0)
    cached = min(read, i) if type(read) is int and read > 0 else 0
    return Usage(input=i - cached, output=o, cached_input=cached)


def _summary_item(sid: str, text: str) -> dict[str, Any]:
    """A worker's summary as an input item (its id is the summary's ledger id)."""
    return {"role": "developer", "content": text, "id": sid}
