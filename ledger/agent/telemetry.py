"""A turn's billed usage as OpenTelemetry span attributes (the GenAI semantic conventions),
and the current span it is set on when opentelemetry-api is installed.

No module of the ledger imports OpenTelemetry at its top: :func:`recording_span` imports
it when first asked (the extra ``otel``), and answers None without it or when no span is
recording, so that a turn's end costs nothing more then.
"""

from __future__ import annotations

import functools
from typing import Any

from ledger.models import Snapshot, Usage

INPUT = "gen_ai.usage.input_tokens"
OUTPUT = "gen_ai.usage.output_tokens"
OPERATION = "gen_ai.operation.name"
CACHE_READ = "gen_ai.usage.cache_read.input_tokens"
CONVERSATION = "gen_ai.conversation.id"
# The turn a span's usage is the sum of (set at the turn's end): a span processor that
# records GenAI calls (ledger.adapters.otel) skips such a span, its calls settled already.
TURN = "ledger.turn"
# The GenAI conventions are at development stage: the names above are pinned to the
# incubating gen_ai attributes of this release (tests/test_ceilings.py compares them).
SEMCONV = "opentelemetry-semantic-conventions 0.66b2"


def usage_attributes(
    session_id: str, usage: Usage, snapshot: Snapshot | None = None, *, turn: int | None = None
) -> dict[str, str | int]:
    """A turn's billed usage as GenAI span attributes, each quantity under one name:
    ``gen_ai.usage.input_tokens`` counts all input, cached included (as the conventions
    ask), ``gen_ai.usage.cache_read.input_tokens`` the cached part, and
    ``gen_ai.conversation.id`` the session. With a snapshot, the window's composition
    under ``ledger.window.``: its size, what is free, and per consumer what items hold
    and open reservations hold (``ledger.window.<consumer>.used`` / ``.reserved``).
    With ``turn``, ``ledger.turn``: the usage is that turn's sum."""
    attrs: dict[str, str | int] = {
        CONVERSATION: session_id,
        INPUT: usage.input + usage.cached_input,
        OUTPUT: usage.output,
        CACHE_READ: usage.cached_input,
    }
    if turn is not None:
        attrs[TURN] = turn
    if snapshot is not None:
        attrs["ledger.window.size"] = snapshot.window
        attrs["ledger.window.free"] = snapshot.free
        attrs["ledger.window.system_prompt"] = snapshot.system_prompt
        attrs["ledger.window.output_reserve"] = snapshot.output_reserve
        for consumer, used in snapshot.used.items():
            attrs[f"ledger.window.{consumer.value}.used"] = used
            attrs[f"ledger.window.{consumer.value}.reserved"] = snapshot.reserved[consumer]
    return attrs


def added(total: Usage | None, usage: Usage) -> Usage:
    """Two calls' billed usage as one (a turn's sum)."""
    if total is None:
        return usage
    return Usage(
        input=total.input + usage.input,
        output=total.output + usage.output,
        cached_input=total.cached_input + usage.cached_input,
    )


@functools.cache
def _trace() -> Any:
    """``opentelemetry.trace``, imported once; None without opentelemetry-api."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    return trace


def recording_span() -> Any:
    """The current OpenTelemetry span when one is recording, else None (no span, a
    non-recording one, or opentelemetry-api not installed)."""
    trace = _trace()
    if trace is None:
        return None
    span = trace.get_current_span()
    return span if span.is_recording() else None


__all__ = [
    "CACHE_READ",
    "CONVERSATION",
    "INPUT",
    "OPERATION",
    "OUTPUT",
    "SEMCONV",
    "TURN",
    "added",
    "recording_span",
    "usage_attributes",
]
