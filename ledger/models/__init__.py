"""Budgets, items and results: plain data shared by the sync and asyncio clients.

A result of four fields or more is keyword-only (``kw_only=True``): it is built by name,
so a reordering of its fields cannot silently swap two of them. A closed set of wire
strings is a ``StrEnum`` (``Regime``, ``Classification``, ...): each member is its string.

One module a kind: ``enums`` (the consumers and the closed sets), ``canonical`` (canonical
JSON, RFC 8785), ``budgets`` (a session's and a budget scope's), ``items`` (items and
reservations), ``turns`` (a turn's calls), ``readings`` (snapshots, audits, a scope's
usage). Every name is imported here: ``from ledger.models import X``.
"""

from __future__ import annotations

from ledger.models.budgets import TOKENS_MAX as TOKENS_MAX
from ledger.models.budgets import Price, ScopeBudget, ScopeSet, SessionBudget
from ledger.models.canonical import canonical_json as canonical_json
from ledger.models.enums import (
    Classification,
    CompactionMode,
    CompactionOutcome,
    Consumer,
    DriftFlag,
    JobKind,
    Regime,
    ToolResultOutcome,
)
from ledger.models.items import (
    Admitted,
    BegunBy,
    CallCost,
    ChildDrawn,
    ChildOpened,
    Deleted,
    Expired,
    HeldItem,
    Item,
    Opened,
    Released,
    Reservation,
    ResetDone,
    Settled,
    Usage,
    Voided,
)
from ledger.models.readings import AuditReport, PartitionCheck, ScopeUsage, Snapshot
from ledger.models.turns import (
    Compaction,
    Reconciled,
    SpanRecorded,
    ToolResult,
    TurnAborted,
    TurnFinished,
    TurnRenewed,
    TurnReport,
    TurnStarted,
)

# Exported by ``ledger`` as they are: a new result model is added to the module of its
# kind, imported above and named here (tests/test_models.py fails on one left out).
__all__ = [
    "Consumer",
    "CompactionMode",
    "Regime",
    "Classification",
    "DriftFlag",
    "CompactionOutcome",
    "ToolResultOutcome",
    "JobKind",
    "SessionBudget",
    "Item",
    "BegunBy",
    "HeldItem",
    "Opened",
    "Admitted",
    "Released",
    "Reservation",
    "Settled",
    "Price",
    "ScopeBudget",
    "CallCost",
    "Usage",
    "ScopeSet",
    "ScopeUsage",
    "ChildOpened",
    "ChildDrawn",
    "Voided",
    "Expired",
    "PartitionCheck",
    "ResetDone",
    "TurnStarted",
    "TurnAborted",
    "TurnRenewed",
    "SpanRecorded",
    "TurnReport",
    "TurnFinished",
    "Reconciled",
    "Compaction",
    "ToolResult",
    "Deleted",
    "AuditReport",
    "Snapshot",
]
