"""Read-only views for operators: one session in detail, the busiest sessions, dead
letters, and budget scopes (a tenant in detail; the scopes the worker exports).

One module a view: ``sessions`` (one session, ``ledger inspect``), ``batched`` (many
sessions read in batches: ``ledger audit``, ``ledger top``), ``dead`` (the dead letters,
``ledger dead``), ``scopes`` (a tenant's budget scopes, ``ledger inspect --tenant``).
Every name is here too: ``from ledger.views import busiest``.
"""

from __future__ import annotations

from ledger.views.batched import (
    BATCH,
    SORTS,
    Damaged,
    FleetStatus,
    audits,
    busiest,
    fleet_status,
    listed,
    placements,
    raw_many,
    read_many,
    snapshots,
    unreadable,
)
from ledger.views.dead import (
    JOB_FIELDS,
    DeadLetter,
    dead_lettered,
    dead_letters,
    purge_dead,
    redis_now_ms,
    replay_dead,
    session_dead_letters,
    take_dead,
)
from ledger.views.scopes import ScopeHold, TenantView, tenant_view
from ledger.views.sessions import JournalEntry, SessionView, regime, stored_outcome, view

__all__ = [
    "BATCH",
    "JOB_FIELDS",
    "SORTS",
    "Damaged",
    "DeadLetter",
    "FleetStatus",
    "JournalEntry",
    "ScopeHold",
    "SessionView",
    "TenantView",
    "audits",
    "busiest",
    "dead_lettered",
    "dead_letters",
    "fleet_status",
    "listed",
    "placements",
    "purge_dead",
    "raw_many",
    "read_many",
    "redis_now_ms",
    "regime",
    "replay_dead",
    "session_dead_letters",
    "snapshots",
    "stored_outcome",
    "take_dead",
    "tenant_view",
    "unreadable",
    "view",
]
