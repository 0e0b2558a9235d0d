"""Loading the Lua scripts that ship in the wheel.

Each operation is one file in the top-level ``lua/`` folder (``ledger/lua`` once
installed). ``_common.lua`` is prepended to each so every script is one chunk;
redis-py's ``Script`` sends it with EVALSHA and reloads it on NOSCRIPT.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import resources
from pathlib import Path

NAMES = (
    "open",
    "admit",
    "release",
    "reserve",
    "settle",
    "void",
    "expire",
    "reset",
    "begin_turn",
    "record_span",
    "end_turn",
    "compact",
    "admit_tool",
    "close",
    "snapshot",
    "audit",
)


def lua_dir() -> Path:
    """Where the .lua files are: inside the installed package, or the repo's lua/."""
    packaged = Path(str(resources.files("ledger"))) / "lua"
    if (packaged / "_common.lua").is_file():
        return packaged
    repo = Path(__file__).resolve().parent.parent / "lua"
    if (repo / "_common.lua").is_file():
        return repo
    raise FileNotFoundError(f"ledger Lua scripts not found in {packaged} or {repo}")


@functools.cache
def source(name: str) -> str:
    """The full text sent to Redis for one operation."""
    if name not in NAMES:
        raise KeyError(f"no ledger script named {name!r}")
    d = lua_dir()
    return (d / "_common.lua").read_text() + "\n" + (d / f"{name}.lua").read_text()


@functools.cache
def sha(name: str) -> str:
    return hashlib.sha1(source(name).encode()).hexdigest()
