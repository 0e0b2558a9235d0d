"""Generate the agent layer's sync face (``sync.py``) from its asyncio face (``aio.py``).

``python -m ledger.agent._unasync`` writes it; ``--check`` exits 1 when it is stale
(a test runs the check). Only these word-level replacements are made, so the two
faces cannot drift apart.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADER = (
    '"""The agent layer\'s synchronous face: :class:`Agent` and its per-turn :class:`Turn`.\n\n'
    "GENERATED from ``ledger/agent/aio.py`` by ``python -m ledger.agent._unasync``: edit\n"
    "that file, not this one.\n"
    '"""'
)
RULES = [
    (r"async with ", "with "),
    (r"async def ", "def "),
    (r"await ", ""),
    (r"__aenter__", "__enter__"),
    (r"__aexit__", "__exit__"),
    (r"\bAsyncAgent\b", "Agent"),
    (r"\bAsyncTurn\b", "Turn"),
    (r"\bAsyncSession\b", "Session"),
    (r"\bdrive_async\b", "drive_sync"),
    (r"\basyncio\.sleep\b", "time.sleep"),
    (r"^import asyncio$", "import time"),
    (r"^from ledger\.aio import", "from ledger.client import"),
    (r"\(asyncio\)", "(sync)"),
]


def generate() -> str:
    text = (HERE / "aio.py").read_text()
    body = text.split('"""', 2)[2]  # drop the module docstring
    for pattern, repl in RULES:
        body = re.sub(pattern, repl, body, flags=re.M)
    return HEADER + body


def main(argv: list[str]) -> int:
    target = HERE / "sync.py"
    out = generate()
    if "--check" in argv:
        if target.read_text() != out:
            print(f"{target} is stale: run python -m ledger.agent._unasync", file=sys.stderr)
            return 1
        return 0
    target.write_text(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
