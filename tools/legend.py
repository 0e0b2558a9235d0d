"""Write the schema legend of ``_common.lua`` from ``ledger/schema/``.

``python tools/legend.py`` (a script of the repository, not shipped in the wheel)
rewrites the block between the legend markers of the scripts' ``_common.lua`` (the
checkout's ``lua/_common.lua``, found through :func:`ledger.scripts.lua_dir`); ``--check``
writes nothing and exits 1 when the block is stale (run by ``.ci/run`` and
tests/test_schema.py). Edit a field in ledger/schema/, never in the legend.

It also writes the line ``local VERSION, OLDEST_LAYOUT, LAYOUT = ...`` of ``_common.lua``
from ``ledger/protocol.py`` (``VERSION``, ``OLDEST_LAYOUT``, ``LAYOUT``): the versions are defined
there only, and the scripts get it from this line.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ledger.protocol import LAYOUT, OLDEST_LAYOUT, VERSION
from ledger.schema import with_legend
from ledger.scripts import lua_dir

_VERSIONS = re.compile(r"^local VERSION, LAYOUT, OLDEST_LAYOUT = .*$", re.M)


def with_versions(source: str) -> str:
    """``source`` with its versions line written from ledger/protocol.py; ValueError when
    it has none."""
    line = f"local VERSION, LAYOUT, OLDEST_LAYOUT = {VERSION}, {LAYOUT}, {OLDEST_LAYOUT}"
    fresh, n = _VERSIONS.subn(line, source)
    if n != 1:
        raise ValueError("_common.lua has no line 'local VERSION, LAYOUT, OLDEST_LAYOUT = ...'")
    return fresh


def common_lua() -> Path:
    return lua_dir() / "_common.lua"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/legend.py", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the legend is stale")
    args = parser.parse_args(argv)
    path = common_lua()
    source = path.read_text()
    try:
        fresh = with_versions(with_legend(source))
    except ValueError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 1
    if args.check:
        if fresh != source:
            print(f"{path}: the schema legend or versions are stale: run python tools/legend.py")
            return 1
        return 0
    if fresh != source:
        path.write_text(fresh)
        print(f"wrote the schema legend of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
