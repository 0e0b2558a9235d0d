"""What a session's billing reports teach its counter: the calibration field of its
summaries hash, and the per-kind factors solved from the last reports."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ledger.agent.counters import KINDS, PLAUSIBLE

# Fields of the session's summaries hash that are no summary ('~' is no id's character):
# JSON {"v": 1, "factors": {kind: factor}, "reports": [[turn, {kind: base count}, billed]]}:
# the factors learned per kind of content, and the last plausible reports they come from
CALIBRATION = "~calibration"
REPORTS_KEPT = 12  # the reports the factors are solved from (the newest)
# a kind's factor is learned once it made this share of a report's prompt, and 64 tokens
# of it (below that, the report tells too little of it: a small error elsewhere would move
# it far)
KIND_SHARE = 0.1


def _calibration(raw: str | None) -> tuple[dict[str, float], list[list[Any]]]:
    """The session's calibration record: the learned factors by kind and the kept reports
    (none of either without a record, or with one this version did not write)."""
    try:
        rec = json.loads(raw) if raw else {}
        factors = {
            str(k): float(v)
            for k, v in rec.get("factors", {}).items()
            if k in KINDS and float(v) > 0
        }
        reports = [list(r) for r in rec.get("reports", []) if len(r) == 3]
    except (ValueError, TypeError, AttributeError):
        return {}, []
    return factors, reports


def _solve(
    reports: Sequence[Sequence[Any]], current: Mapping[str, float], priors: Mapping[str, float]
) -> dict[str, float]:
    """The factor of each kind the reports tell enough of (``KIND_SHARE`` of some
    report's prompt, and 64 tokens): least squares over the reports, each
    ``sum(factor[kind] x base count[kind]) = billed`` (a larger report, whose bill rounds
    less, weighs more), held near the current factors (or the priors) where the reports
    cannot tell kinds apart. A solved factor outside its kind's plausible range is not
    learned."""
    kinds = sorted({k for _, raw, _ in reports for k in raw})
    told = {
        k
        for _, raw, billed in reports
        for k in raw
        if billed > 0
        and raw[k] * priors[k] >= max(64, KIND_SHARE * sum(n * priors[j] for j, n in raw.items()))
    }
    if not kinds or not told:
        return {}
    n = len(kinds)
    a = [[0.0] * n for _ in range(n)]
    y = [0.0] * n
    for _, raw, billed in reports:
        if billed <= 0:
            continue
        x = [float(raw.get(k, 0)) for k in kinds]
        for i in range(n):
            y[i] += x[i] * billed
            for j in range(n):
                a[i][j] += x[i] * x[j]
    for i, k in enumerate(kinds):  # a light pull toward what is known of each kind
        g = current.get(k, priors[k])
        w = 1e-3 * max(a[i][i], 1e-12) + (0.0 if k in told else 1e3 * max(a[i][i], 1e-12))
        a[i][i] += w
        y[i] += w * g
    f = _gauss(a, y)
    out = {}
    for k, v in zip(kinds, f, strict=True):
        if k in told and PLAUSIBLE[0] * priors[k] <= v <= PLAUSIBLE[1] * priors[k]:
            out[k] = round(v, 4)
    return out


def _gauss(a: list[list[float]], y: list[float]) -> list[float]:
    """Solve a x = y (a small symmetric positive definite system) by elimination."""
    n = len(y)
    m = [[*row, v] for row, v in zip(a, y, strict=True)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if abs(m[c][c]) < 1e-300:
            return [0.0] * n
        for r in range(n):
            if r != c:
                q = m[r][c] / m[c][c]
                m[r] = [u - q * v for u, v in zip(m[r], m[c], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]
