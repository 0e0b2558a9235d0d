"""A tenant's budget scopes in detail (``ledger inspect --tenant``, docs/ceilings.md):
each scope's window, its open holds and the tenant's sessions."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

from ledger import protocol, schema
from ledger.client import Ledger
from ledger.errors import LedgerError, UnknownScope
from ledger.models import ScopeUsage
from ledger.scope_reads import scope_names, scope_reads
from ledger.views.batched import _whole, listed


@dataclass(frozen=True, slots=True, kw_only=True)
class ScopeHold:
    """An open hold of a scope: a reservation of a session, what it holds per quantity
    (``ScopeUsage``'s names), until ``deadline_ms`` on Redis's clock (``overdue`` past it:
    the next reserve in the scope gives it back)."""

    scope: str
    session_id: str
    reservation: str
    deadline_ms: int
    held: Mapping[str, int]
    overdue: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantView:
    """A tenant as ``ledger inspect --tenant`` shows it: its scopes' windows (the tenant's
    own first), their open holds (soonest deadline first) and its sessions' ids."""

    tenant: str
    now_ms: int
    scopes: list[ScopeUsage]
    holds: list[ScopeHold]
    sessions: list[str]


def tenant_view(ledger: Ledger, tenant: str) -> TenantView:
    names = scope_names(ledger, tenant)
    now, reads = scope_reads(ledger, names)
    usages, holds = [], []
    for name, fields, index in reads:
        try:
            usages.append(protocol.scope_usage(name, fields, index, now))
        except UnknownScope:
            continue
        except (
            ValueError,
            IndexError,
            KeyError,
            struct.error,
        ) as exc:  # written by hand or by another program
            raise LedgerError(
                f"scope {name}: damaged: its hash does not read as the scripts write it "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        for member, deadline in index:
            sid, _, rid = member.rpartition("|")
            raw = schema.text(fields.get("q:" + member, ""))
            parts = raw.split("|")
            if len(parts) < 5 or not all(_whole(x) for x in parts[:5]):
                continue  # given back since the index was read
            held = dict(
                zip(("input", "output", "cached_input", "money"), map(int, parts[1:5]), strict=True)
            )
            holds.append(
                ScopeHold(
                    scope=name,
                    session_id=sid,
                    reservation=rid,
                    deadline_ms=int(deadline),
                    held=held,
                    overdue=deadline < now,
                )
            )
    usages.sort(key=lambda u: (u.scope != tenant, u.scope))
    holds.sort(key=lambda h: (h.deadline_ms, h.scope, h.session_id, h.reservation))
    mine = f"@{tenant}/"
    sessions = [sid for sid in listed(ledger) if sid.startswith(mine)]
    return TenantView(tenant=tenant, now_ms=now, scopes=usages, holds=holds, sessions=sessions)
