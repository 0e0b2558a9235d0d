"""Generate the sync faces from their asyncio sources (not part of the package).

Each ``ledger/_async/<name>.py`` is the source of ``ledger/_sync/<name>.py``: ``client``
(``Ledger``, ``Session``), ``agent`` (``Agent``, ``Turn``), ``langgraph`` (``LedgerGraph``)
and ``langchain`` (``LedgerMiddleware``); the public modules (``ledger.client``,
``ledger.aio``, ``ledger.agent.sync``, ``ledger.agent.aio``, ``ledger.adapters.langgraph``,
``ledger.adapters.langchain``) re-export them. ``python tools/unasync.py`` writes them all;
``--check`` writes nothing and exits 1 when one is stale (a test and CI run the check).
Each file is made by word-level regular expressions only (the common ones, then its
own), so a face cannot drift from its source: what cannot be written once for both
belongs in a neutral module (``ledger/core.py``, ``ledger/agent/core.py``,
``ledger/adapters/graph_core.py``), not in a rule.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository

Rules = tuple[tuple[str, str], ...]

# Applied to every twin, in this order, after the twin's own rules.
COMMON: Rules = (
    (r"\(await ([\w.]+\(\))\)", r"\1"),  # (await x.f()).y -> x.f().y
    (r"async with ", "with "),
    (r"async for ", "for "),
    (r"async def ", "def "),
    (r"await ", ""),
    (r"__aenter__", "__enter__"),
    (r"__aexit__", "__exit__"),
    (r"\basyncio\.sleep\b", "time.sleep"),
    (r"\(asyncio\)", "(sync)"),
    (r"\bAsyncSession\b", "Session"),
    (r"\bledger\._async\.", "ledger._sync."),
    (r"^(from collections\.abc import )Awaitable, ", r"\1"),
    (r"\bAwaitable\[((?:[^\[\]]|\[[^\[\]]*\])*)\]", r"\1"),  # Awaitable[list[Any]] -> list[Any]
)


# The framework adapters' faces: the framework's asyncio methods and the agent layer's.
ADAPTER: Rules = (
    (r"\bAsyncLedgerGraph\b", "LedgerGraph"),
    (r"\bAsyncAgent\b", "Agent"),
    (r"\bAsyncTurn\b", "Turn"),
    (r"\bAsyncIterator\b", "Iterator"),
    (r"\basynccontextmanager\b", "contextmanager"),
    (r"\baclosing\b", "closing"),
    (r"\.a(invoke|list|get_tuple)\(", r".\1("),
)


@dataclass(frozen=True)
class Twin:
    """``ledger/_sync/<name>.py``, generated from ``ledger/_async/<name>.py``."""

    name: str
    header: str  # the generated file's module docstring (the source's is dropped)
    rules: Rules

    @property
    def source(self) -> str:
        return f"ledger/_async/{self.name}.py"

    @property
    def target(self) -> str:
        return f"ledger/_sync/{self.name}.py"

    def generate(self) -> str:
        text = (ROOT / self.source).read_text()
        body = text.split('"""', 2)[2]  # drop the module docstring
        for pattern, repl in self.rules + COMMON:
            body = re.sub(pattern, repl, body, flags=re.M)
        head = (
            f"# GENERATED from {self.source} by tools/unasync.py: edit that file, not this one.\n"
            f'"""{self.header}"""'
        )
        return head + body


TWINS = (
    Twin(
        name="client",
        header="The synchronous face: :class:`Ledger` and :class:`Session`.",
        rules=(
            (r"^import asyncio\nimport functools$", "import functools\nimport time"),
            (
                r"^from redis\.asyncio\.cluster import RedisCluster as AsyncRedisCluster$",
                "from redis.cluster import RedisCluster",
            ),
            (r"\bAsyncRedisCluster\b", "RedisCluster"),
            (r"\bAsyncScript\b", "Script"),
            (r"\bAsyncClient\b", "SyncClient"),
            (r"\basync_client\b", "sync_client"),
            (r"\basync_primary\b", "sync_primary"),
            (r"\bAsyncLedger\b", "Ledger"),
            (r"\baclose\b", "close"),
        ),
    ),
    Twin(
        name="agent",
        header=(
            "The agent layer's synchronous face: :class:`Agent` and its per-turn :class:`Turn`."
        ),
        rules=(
            (r"^import asyncio\nimport contextlib$", "import contextlib\nimport time"),
            (r"\bAsyncAgent\b", "Agent"),
            (r"\bAsyncTurn\b", "Turn"),
            (r"\bAsyncHeartbeat\b", "Heartbeat"),
        ),
    ),
    Twin(
        name="langgraph",
        header="The LangGraph adapter's synchronous face: :class:`LedgerGraph`.",
        rules=(
            (
                r"^from collections\.abc import AsyncIterator, Callable, Sequence$",
                "from collections.abc import Callable, Iterator, Sequence",
            ),
            *ADAPTER,
        ),
    ),
    Twin(
        name="langchain",
        header="The LangChain middleware's synchronous face: :class:`LedgerMiddleware`.",
        rules=(
            (
                r"^from collections\.abc import AsyncIterator, Awaitable, Callable, Sequence$",
                "from collections.abc import Callable, Iterator, Sequence",
            ),
            (r"\bAsyncLedgerMiddleware\b", "LedgerMiddleware"),
            (r"\ba(before_model|after_model|wrap_model_call|wrap_tool_call)\b", r"\1"),
            *ADAPTER,
        ),
    ),
)


def stale(twin: Twin) -> bool:
    """Whether the twin's checked-in file differs from what its source generates."""
    path = ROOT / twin.target
    return not path.exists() or path.read_text() != twin.generate()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/unasync.py", description="Generate the sync faces."
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when a generated file differs from what its source makes",
    )
    args = parser.parse_args(argv)
    if args.check:
        old = [t.target for t in TWINS if stale(t)]
        for name in old:
            print(f"{name} is stale: run python tools/unasync.py", file=sys.stderr)
        return 1 if old else 0
    for twin in TWINS:
        (ROOT / twin.target).write_text(twin.generate())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
