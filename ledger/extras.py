"""Optional dependencies: each feature beyond the client is an extra of the package.

The client (``pip install redis-token-ledger``) needs only redis, pydantic,
pydantic-settings and tenacity; ``import ledger`` imports nothing more. The rest are
extras, imported only when their feature is used:

=================  ==========================================================
``embedded``       the in-process backend, ``embedded://`` (fakeredis + lupa)
``cli``            the output of ``ledger demo``, ``top``, ``inspect``, ``audit`` (rich)
``worker``         the background worker, ``ledger worker`` (prometheus-client)
``demo``           ``ledger demo``: ``embedded``, ``cli`` and ``worker``
``plot``           ``ledger demo --plot`` (matplotlib)
``tokenizer``      :class:`ledger.agent.TiktokenCounter` (tiktoken)
``summarizer``     the worker's LLM summarizer (httpx, ``tokenizer``)
``langgraph``, ``openai-agents``, ``otel``: the framework adapters
``all``            every extra above
=================  ==========================================================

Using a feature whose extra is not installed raises :class:`MissingExtra`, whose
message ends with the line that installs it, e.g.
``pip install "redis-token-ledger[embedded]"``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ledger.errors import ConfigurationError

DISTRIBUTION = "redis-token-ledger"


class MissingExtra(ConfigurationError):
    """A feature's optional dependency is not installed."""


def install_line(extra: str) -> str:
    """The command that installs ``extra`` (double quotes: any shell, and cmd.exe)."""
    return f'pip install "{DISTRIBUTION}[{extra}]"'


def missing(module: str, extra: str, feature: str) -> MissingExtra:
    """The error for ``feature``, whose ``module`` (from ``extra``) is not installed."""
    return MissingExtra(f"{feature} needs the {module!r} package: {install_line(extra)}")


def need(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``, or raise MissingExtra naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise missing(module, extra, feature) from exc
