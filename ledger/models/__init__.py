"""Budgets, items and results: plain data shared by the sync and asyncio clients.

A result of four fields or more is keyword-only (``kw_only=True``): it is built by name,
so a reordering of its fields cannot silently swap two of them. A closed set of wire
strings is a ``StrEnum`` (``Regime``, ``Classification``, ...): each member is its string.

One module a kind: ``enums`` (the consumers and the closed sets), ``canonical`` (canonical
JSON, RFC 8785), ``budgets`` (a session's and a budget scope's), ``items`` (items and
reservations), ``turns`` (a turn's calls), ``readings`` (snapshots, audits, a scope's
usage). Every name is imported here: ``from ledger.models import X``; ``__all__`` is
the modules' own ``__all__`` lists together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ledger.models import budgets as _budgets
from ledger.models import enums as _enums
from ledger.models import items as _items
from ledger.models import readings as _readings
from ledger.models import turns as _turns
from ledger.models.budgets import *  # noqa: F403
from ledger.models.budgets import TOKENS_MAX as TOKENS_MAX
from ledger.models.canonical import canonical_json as canonical_json
from ledger.models.enums import *  # noqa: F403
from ledger.models.items import *  # noqa: F403
from ledger.models.readings import *  # noqa: F403
from ledger.models.turns import *  # noqa: F403

# Exported by ``ledger`` as they are: every name of each module's own ``__all__`` (its
# classes; tests/test_models.py fails on one left out), so a new result model is added to
# the module of its kind and nowhere else (a new module of models is imported above).
# Not for mypy, which reads an ``__all__`` only when it is a literal list: without one it
# sees the public names above, each module's ``__all__`` through its star import, and so
# ``from ledger import X`` keeps X's type.
if not TYPE_CHECKING:
    __all__ = [
        *_enums.__all__,
        *_budgets.__all__,
        *_items.__all__,
        *_turns.__all__,
        *_readings.__all__,
    ]
