"""OpenTelemetry span processor: GenAI spans into ``record_span`` (extra ``otel``).

ACCOUNTING AFTER THE FACT. A span ends after its call was made, so this processor
can only record what a call cost (the amplification ratio, the fan-out counters);
it cannot keep a prompt from exceeding the window. A guard must act before the call:
the adapters' model wrapper and input filter, or ``record_span`` called by your code
before each memory-tool call.

    provider.add_span_processor(LedgerSpanProcessor(session))

Every ended span with ``gen_ai.usage.input_tokens`` (OpenTelemetry GenAI semantic
conventions) but no ``ledger.turn`` (a turn's billed usage, which the agent layer sets at
the turn's end: not a call) is recorded against the session's current turn, its kind being
``gen_ai.operation.name`` (``chat``, ``embeddings``, ``execute_tool``...). A refusal
(``FanoutRefused`` past the pathological threshold) or any ledger error is kept in
``errors``, never raised into the tracer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ledger.agent.telemetry import (
    CACHE_READ,
    CONVERSATION,
    INPUT,
    OPERATION,
    OUTPUT,
    SEMCONV,
    TURN,
    usage_attributes,
)
from ledger.client import Session
from ledger.errors import InvalidArgument, LedgerError
from ledger.extras import missing

try:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise missing("opentelemetry-sdk", "otel", "LedgerSpanProcessor") from exc


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
        if TURN in attrs:  # a turn's sum (set at its end): its calls were settled already
            return
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


# the attribute names and usage_attributes are the agent layer's (ledger.agent.telemetry),
# which sets them on the current span at each turn's end with no processor
__all__ = [
    "CACHE_READ",
    "CONVERSATION",
    "INPUT",
    "OPERATION",
    "OUTPUT",
    "SEMCONV",
    "TURN",
    "LedgerSpanProcessor",
    "usage_attributes",
]
