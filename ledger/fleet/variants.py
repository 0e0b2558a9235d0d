"""The ledger with one rule off: the demo's third column, each rule shown by its absence.

Each scenario names the rule it shows (docs/rules.md) and how the demo takes it away:

- 001 ``compaction-credit``: a variant of the ledger's scripts that the demo loads in
  place of the packaged ones, for its agents and its worker alike. ``admit.lua`` judges
  retrieval and recall on the current free room even while a compaction is pending (no
  post-compaction bound), and ``compact.lua`` takes whatever the summarizer produced as
  a compaction (no hard post-condition) and never escalates to a hard reset.
  ``begin_turn.lua`` still refuses to begin a turn while a compaction is pending (the
  agent waits for it, bounded, as with the rule), and lands a staged one as
  ``compact.lua`` does without the rule.
  The variants are the packaged texts with those two expressions replaced; a packaged
  script that no longer has one is an error, never a silent no-op.
- 000 ``working-memory``: the agent declares no working set, so ``begin_turn`` judges
  and reclaims nothing (the retention policies stay as they are).
- 002 ``spill``: the agent admits the head of a tool result that does not fit (the
  longest prefix the ledger takes) instead of ``tool_result``, which spills it whole.
- 004 ``amplification``: the session's pathological threshold is set out of reach
  (``amplification_pathological=1000``), so the fan-out guard never says stop.

The production scripts carry no branch for any of this.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from ledger import scripts
from ledger.client import Ledger

RULES: Final = {
    "001": "compaction-credit",
    "000": "working-memory",
    "002": "spill",
    "004": "amplification",
}

# script -> [(packaged expression, the variant's)], for the compaction-credit rule
_NO_CREDIT: Final = {
    "admit": [
        (
            "local cap, pending, bound, pm, base = nil, A == 'a_rm' and v[11] == '1', nil, 0, 0",
            "local cap, pending, bound, pm, base = nil, false, nil, 0, 0",
        )
    ],
    "compact": [
        ("local ok = fits and judged <= H.HW and not deferred", "local ok = fits"),
        (
            "local escalate = (not ok) and kf >= H.cx and H.rq == 0",
            "local escalate = false",
        ),
    ],
}


# begin_turn lands staged compactions with the same judgement (compaction_effect)
_NO_CREDIT["begin_turn"] = _NO_CREDIT["compact"]


def source_without_credit(name: str) -> str:
    """The full text of script `name` with the compaction-credit rule taken out."""
    text = scripts.source(name)
    for old, new in _NO_CREDIT[name]:
        if text.count(old) != 1:
            raise RuntimeError(
                f"{name}.lua no longer reads {old!r} exactly once: the demo's variant "
                "without compaction credit must follow it (ledger/fleet/variants.py)"
            )
        text = text.replace(old, new)
    return text


def load(ledger: Ledger, sources: Mapping[str, str]) -> Ledger:
    """`ledger`, each script named in `sources` replaced by the text given (the rule
    tests load the packaged scripts with one rule taken out where it lives)."""
    for name, text in sources.items():
        if name not in ledger._scripts:
            raise ValueError(f"no script named {name!r}")
        ledger._scripts[name] = ledger.client.register_script(text)
    return ledger


def without_credit(ledger: Ledger) -> Ledger:
    """`ledger`, its admit and compact scripts replaced by the variants above."""
    for name in _NO_CREDIT:
        ledger._scripts[name] = ledger.client.register_script(source_without_credit(name))
    return ledger
