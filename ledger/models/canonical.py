"""Canonical JSON (RFC 8785, the JSON Canonicalization Scheme): the text of a budget any
language reproduces byte for byte, whose SHA-256 is its fingerprint."""

from __future__ import annotations

import decimal
import json
import math
from collections.abc import Mapping, Sequence

from ledger.errors import InvalidArgument


def _number(x: float) -> str:
    """A float as ECMAScript's Number::toString writes it (JSON.stringify, RFC 8785):
    integral values as integers, others in the shortest form that reads back the same."""
    if not math.isfinite(x):
        raise InvalidArgument(f"canonical JSON has no {x!r}")
    if x == 0:
        return "0"
    sign = "-" if x < 0 else ""
    t = decimal.Decimal(repr(abs(x))).as_tuple()  # repr: the shortest round-trip digits
    digits = "".join(map(str, t.digits)).rstrip("0")
    n = len(t.digits) + int(t.exponent)  # abs(x) = 0.<digits> * 10 ** n
    k = len(digits)
    if k <= n <= 21:
        out = digits + "0" * (n - k)
    elif 0 < n <= 21:
        out = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        out = "0." + "0" * -n + digits
    else:
        e = n - 1
        out = digits[0] + ("." + digits[1:] if k > 1 else "") + "e" + ("+" if e > 0 else "-")
        out += str(abs(e))
    return sign + out


def canonical_json(value: object) -> str:
    """JSON any language reproduces byte for byte (RFC 8785, the JSON Canonicalization
    Scheme): object keys sorted, no whitespace, integers as integers, floats as
    ECMAScript writes them (``3.0`` is ``3``, ``0.1`` is ``0.1``), strings with only
    the escapes JSON requires (non-ASCII written as itself, to be encoded as UTF-8)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise InvalidArgument("canonical JSON object keys must be strings")
        # RFC 8785 sorts by UTF-16 code units; Python compares code points, which
        # agrees for every key below U+10000 (budget fields are ASCII).
        keys = sorted(value, key=lambda k: k.encode("utf-16-be"))
        return "{" + ",".join(f"{canonical_json(k)}:{canonical_json(value[k])}" for k in keys) + "}"
    if isinstance(value, Sequence):
        return "[" + ",".join(canonical_json(v) for v in value) + "]"
    raise InvalidArgument(f"canonical JSON has no {type(value).__name__}")
