"""Optional dependencies: each feature beyond the client is an extra of the package.

The client needs only redis, pydantic, pydantic-settings and tenacity. The embedded
backend, the command line, the worker, the plot and each framework adapter are
extras; using one that is not installed raises :class:`MissingExtra`, which names
the ``pip install`` line.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ledger.errors import ConfigurationError

DISTRIBUTION = "redis-token-ledger"


class MissingExtra(ConfigurationError):
    """A feature's optional dependency is not installed."""


def need(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``, or raise MissingExtra naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(
            f"{feature} needs the {module!r} package: pip install '{DISTRIBUTION}[{extra}]'"
        ) from exc
