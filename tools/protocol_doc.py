"""Write the parts of ``docs/protocol.md`` that the scripts' specs give.

``python tools/protocol_doc.py`` (a script of the repository, not shipped in the wheel)
rewrites, in the chapter "The scripts" of ``docs/protocol.md``:

* the table of how many KEYS each script takes (each header's ``-- KEYS count:``, or the
  number of its KEYS lines), between its markers;
* in each script's section ``### `<name>```, the block between the ``spec`` markers: the
  script's KEYS and ARGV (positions and names, ranges, units, ids) and whether it is
  read-only, as its Lua header says (``ledger/specs.py``);
* a section for a script that has none: its heading, the header's summary, its reply and
  errors (written once: the text outside the markers is the doc's own from then on) and
  its block.

``--check`` writes nothing and exits 1 when the doc is stale, or when a section names a
script that does not exist (run by ``.ci/run`` and tests/test_protocol.py). Edit a
script's KEYS and ARGV in its Lua header, never in a block.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ledger import scripts
from ledger.specs import Entry, Spec

ROOT = Path(__file__).resolve().parent.parent
DOC = Path("docs/protocol.md")
CHAPTER = "## The scripts\n"
TABLE_BEGIN = "<!-- KEYS counts: generated from the lua/ headers by tools/protocol_doc.py -->"
TABLE_END = "<!-- /KEYS counts -->"
BLOCK_END = "<!-- /spec -->"


def block_begin(name: str) -> str:
    return f"<!-- spec: generated from lua/{name}.lua by tools/protocol_doc.py -->"


_BLOCK = re.compile(
    r"\n*<!-- spec: generated from lua/\w+\.lua by [^\n]*-->\n.*?<!-- /spec -->\n", re.S
)
_SECTION = re.compile(r"^### `(\w+)`\n", re.M)


def _entry(e: Entry) -> str:
    details = [d for d in (e.range_text, e.unit, "an id" if e.is_id else None) if d]
    text = f"{e.kind}[{e.where}] {e.name}" + (f" ({', '.join(details)})" if details else "")
    return f"optional {text}" if e.optional else text


def block(spec: Spec) -> str:
    """A section's generated block: what the script's spec says of its keys and arguments."""
    mode = "read-only" if spec.read_only else "mutating"
    return "\n".join(
        [
            block_begin(spec.name),
            f"The spec of `lua/{spec.name}.lua` ({mode}; KEYS[-1] is the last key):",
            "",
            "- " + "; ".join(_entry(k) for k in spec.keys),
            "- " + "; ".join(_entry(a) for a in spec.argv),
            BLOCK_END,
            "",
        ]
    )


def new_section(spec: Spec) -> str:
    """The section of a script the doc does not have yet: heading, summary, reply, errors."""
    summary = spec.summary[:1].upper() + spec.summary[1:]
    errors = ", ".join(spec.errors) or "none"
    return f"### `{spec.name}`\n\n{summary}\n\n- Reply: `{spec.reply}`\n- Errors: {errors}\n"


def table(names: list[str], specs: dict[str, Spec]) -> str:
    rows = [f"| `{n}` | {specs[n].key_count} |" for n in names]
    return "\n".join([TABLE_BEGIN, "", "| script | KEYS |", "| --- | --- |", *rows, "", TABLE_END])


class StaleError(ValueError):
    pass


def generate(doc: str, specs: dict[str, Spec]) -> str:
    """``doc`` with its generated parts written from ``specs`` (every script's)."""
    start = doc.index(CHAPTER)
    end = doc.find("\n## ", start + len(CHAPTER))
    end = len(doc) if end < 0 else end + 1
    chapter = doc[start:end]
    heads = list(_SECTION.finditer(chapter))
    unknown = [m.group(1) for m in heads if m.group(1) not in specs]
    if unknown:
        raise StaleError(f"{DOC}: sections of no script: {', '.join(unknown)}")
    intro = chapter[: heads[0].start()] if heads else chapter
    sections = {
        m.group(1): chapter[m.start() : heads[k + 1].start() if k + 1 < len(heads) else None]
        for k, m in enumerate(heads)
    }
    order = [m.group(1) for m in heads] + sorted(set(specs) - set(sections))
    out = []
    for name in order:
        text = sections.get(name) or new_section(specs[name])
        text = _BLOCK.sub("\n", text).rstrip("\n")
        out.append(f"{text}\n\n{block(specs[name])}\n")
    begin, stop = intro.find(TABLE_BEGIN), intro.find(TABLE_END)
    if begin < 0 or stop < begin:
        raise StaleError(f"{DOC}: no KEYS count table markers in '{CHAPTER.strip()}'")
    intro = intro[:begin] + table(order, specs) + intro[stop + len(TABLE_END) :]
    return (
        doc[:start]
        + intro
        + "".join(out).rstrip("\n")
        + "\n"
        + ("\n" if end < len(doc) else "")
        + doc[end:]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/protocol_doc.py", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the doc is stale")
    args = parser.parse_args(argv)
    path = ROOT / DOC
    doc = path.read_text()
    try:
        fresh = generate(doc, {name: scripts.spec(name) for name in scripts.NAMES})
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.check:
        if fresh != doc:
            print(f"{DOC} is stale: run python tools/protocol_doc.py", file=sys.stderr)
            return 1
        return 0
    if fresh != doc:
        path.write_text(fresh)
        print(f"wrote the generated parts of {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
