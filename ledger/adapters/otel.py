"""OpenTelemetry span processor: GenAI spans into ``record_span`` (extra ``otel``).

ACCOUNTING AFTER THE FACT. A span ends after its call was made, so this processor
can only record what a call cost (the amplification ratio, the fan-out counters);
it cannot keep a prompt from exceeding the window. A guard must act before the call:
the adapters' model wrapper and input filter, or ``record_span`` called by your code
before each memory-tool call.

    provider.add_span_processor(LedgerSpanProcessor(session))

Every ended span with ``gen_ai.usage.input_tokens`` (OpenTelemetry GenAI semantic
conventions) is recorded against the session's current turn, its kind being
``gen_ai.operation.name`` (``chat``, ``embeddings``, ``execute_tool``...). A refusal
(``FanoutRefused`` past the pathological threshold) or any ledger error is kept in
``errors``, never raised into the tracer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ledger.client import Session
from ledger.errors import InvalidArgument, LedgerError
from ledger.extras import missing
from ledger.models import Snapshot, Usage

try:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise missing("opentelemetry-sdk", "otel", "LedgerSpanProcessor") from exc

INPUT = "gen_ai.usage.input_tokens"
OUTPUT = "gen_ai.usage.output_tokens"
OPERATION = "gen_ai.operation.name"
CACHE_READ = "gen_ai.usage.cache_read.input_tokens"
CONVERSATION = "gen_ai.conversation.id"
# The GenAI conventions are at development stage: the names above are pinned to the
# incubating gen_ai attributes of this release (tests/test_ceilings.py compares them).
SEMCONV = "opentelemetry-semantic-conventions 0.66b2"


def usage_attributes(
    session_id: str, usage: Usage, snapshot: Snapshot | None = None
) -> dict[str, str | int]:
    """A turn's billed usage as GenAI span attributes, each quantity under one name:
    ``gen_ai.usage.input_tokens`` counts all input, cached included (as the conventions
    ask), ``gen_ai.usage.cache_read.input_tokens`` the cached part, and
    ``gen_ai.conversation.id`` the session. With a snapshot, the window's composition
    under ``ledger.window.``: its size, what is free, and per consumer what items hold
    and open reservations hold (``ledger.window.<consumer>.used`` / ``.reserved``)."""
    attrs: dict[str, str | int] = {
        CONVERSATION: session_id,
        INPUT: usage.input + usage.cached_input,
        OUTPUT: usage.output,
        CACHE_READ: usage.cached_input,
    }
    if snapshot is not None:
        attrs["ledger.window.size"] = snapshot.window
        attrs["ledger.window.free"] = snapshot.free
        attrs["ledger.window.system_prompt"] = snapshot.system_prompt
        attrs["ledger.window.output_reserve"] = snapshot.output_reserve
        for consumer, used in snapshot.used.items():
            attrs[f"ledger.window.{consumer.value}.used"] = used
            attrs[f"ledger.window.{consumer.value}.reserved"] = snapshot.reserved[consumer]
    return attrs


class LedgerSpanProcessor(SpanProcessor):
    """Records GenAI spans with ``record_span`` once they end (after the fact)."""

    def __init__(self, session: Session, turn: Callable[[], int] | None = None) -> None:
        if not isinstance(session, Session):
            raise InvalidArgument(
                "LedgerSpanProcessor records through a sync Session (a span processor's "
                f"on_end cannot await), got {type(session).__name__}"
            )
        self.session = session
        self.turn = turn or (lambda: session.snapshot().turn)
        self.errors: list[LedgerError] = []
        self.recorded = 0

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        attrs: Any = span.attributes or {}
        tokens_in = attrs.get(INPUT)
        if type(tokens_in) is not int or tokens_in < 0:
            return
        tokens_out = attrs.get(OUTPUT)
        kind = re.sub(r"[^A-Za-z0-9._:/@+=#-]", "_", str(attrs.get(OPERATION) or "genai"))[:64]
        try:
            self.session.record_span(
                self.turn(),
                kind,
                tokens_in,
                tokens_out if type(tokens_out) is int and tokens_out >= 0 else 0,
            )
            self.recorded += 1
        except LedgerError as exc:
            self.errors.append(exc)

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


__all__ = ["LedgerSpanProcessor", "usage_attributes"]
