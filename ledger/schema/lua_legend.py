"""The legend of ``_common.lua``, generated from the schema (``python tools/legend.py``)."""

from __future__ import annotations

from ledger.schema.base import CONSUMERS, OWNERS, UNITS, WORKER_OWNERS, fields

BEGIN = "-- BEGIN SCHEMA LEGEND (generated from ledger/schema/ by `python tools/legend.py`)"
END = "-- END SCHEMA LEGEND"


def _wrap(text: str, width: int) -> list[str]:
    lines, cur = [], ""
    for word in text.split():
        if cur and len(cur) + 1 + len(word) > width:
            lines.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    return [*lines, cur]


def legend() -> str:
    """The legend block of _common.lua: every field the scripts may touch (of an owner
    not in :data:`WORKER_OWNERS`), by owner, markers included."""
    out = [BEGIN]
    consumers = ", ".join(f"{c} {n}" for c, n in CONSUMERS.items())
    out += [f"-- {line}" for line in _wrap(
        f"Consumer letters <c> (a letter means a consumer only): {consumers}. The claim "
        "groups are named by their consumers' letters: a_w/F_w working memory, a_rm/F_rm the "
        "memory group (retrieval r + recall m), a_s scratchpad (no floor: "
        "F_s is never written). Units: " + "; ".join(f"{k} = {v}" for k, v in UNITS.items())
        + ".", 86)]  # fmt: skip
    for owner, where in OWNERS.items():
        if owner in WORKER_OWNERS:
            continue
        out.append("--")
        out += [f"-- {line}" for line in _wrap(f"{owner}: {where}", 86)]
        for f in fields(owner):
            text = _wrap(f"{f.name} [{f.unit}]: {f.meaning}", 70)
            out.append(f"--   {f.wire:<14} {text[0]}")
            out += [f"--   {'':<14} {line}" for line in text[1:]]
    out.append(END)
    return "\n".join(out) + "\n"


def with_legend(source: str) -> str:
    """``source`` (the text of _common.lua) with its legend block replaced by
    :func:`legend`; ValueError when it has no markers."""
    start, end = source.find(BEGIN.split(" (", 1)[0]), source.find(END)
    if start < 0 or end < start:
        raise ValueError(f"_common.lua has no legend markers ({BEGIN!r} ... {END!r})")
    return source[:start] + legend() + source[end + len(END) + 1 :]
