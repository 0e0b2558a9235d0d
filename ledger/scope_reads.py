"""Reads of the budget scopes (docs/ceilings.md) for the operators' views and the
worker's metrics: which scopes have ceilings set, and each one's window as it stands.
Read-only, on the sync face; no script runs."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from ledger import protocol, schema
from ledger.client import Ledger
from ledger.errors import InvalidArgument, UnknownScope, translated
from ledger.models import ScopeUsage

BATCH = 500  # scopes per round trip


def scope_names(ledger: Ledger, tenant: str | None = None) -> list[str]:
    """Every budget scope whose ceilings were set (``set_scope``), found by one SCAN with a
    MATCH on the scope hashes' key prefix (on a cluster, on every primary), sorted; with
    ``tenant``, only the tenant's own scope and those within it."""
    ks = ledger.keyspace
    if tenant is not None and ks.scope(tenant).tenant != tenant:
        raise InvalidArgument(f"a tenant is a scope without '/', got {tenant!r}")
    ledger.check_open()
    out = set()
    with translated():
        for k in ledger.client.scan_iter(match=ks.scope_pattern(tenant), count=1000):
            name = ks.scope_name_of(schema.text(k))
            if name is None:
                continue
            if tenant is None or name == tenant or name.startswith(tenant + "/"):
                out.add(name)
    return sorted(out)


def scope_reads(
    ledger: Ledger, names: Sequence[str]
) -> tuple[int, list[tuple[str, dict[str, Any], list[tuple[str, float]]]]]:
    """Redis's clock, and each scope's hash and holds index (HGETALL, ZRANGE WITHSCORES):
    one pipelined round trip, without MULTI/EXEC (a view, not one atomic read)."""
    ks = ledger.keyspace
    ledger.check_open()
    with translated():
        secs, micros = ledger.client.time()
        replies: list[Any] = []
        for at in range(0, len(names), BATCH):
            chunk = names[at : at + BATCH]
            with ledger.client.pipeline(transaction=False) as pipe:
                for name in chunk:
                    sk = ks.scope(name)
                    pipe.hgetall(sk.hash)
                    pipe.zrange(sk.holds, 0, -1, withscores=True)
                replies += pipe.execute()
    out = []
    for name, fields, holds in zip(names, replies[::2], replies[1::2], strict=True):
        f = {schema.text(k): v for k, v in fields.items()}  # values raw: cf and w are packed
        out.append((name, f, [(schema.text(m), float(d)) for m, d in holds]))
    return int(secs) * 1000 + int(micros) // 1000, out


def scope_usages(
    ledger: Ledger, names: Sequence[str], damaged: dict[str, str] | None = None
) -> list[ScopeUsage]:
    """Each named scope's window as it stands (``Ledger.scope_usage``), in one pipelined
    round trip per ``BATCH`` scopes; a scope deleted since it was listed is left out, and
    so is one whose hash does not read as the scripts write it (a field that holds no
    number), put in ``damaged`` with what is wrong when that is given (else raised)."""
    now, reads = scope_reads(ledger, names)
    out = []
    for name, fields, holds in reads:
        try:
            out.append(protocol.scope_usage(name, fields, holds, now))
        except UnknownScope:
            continue
        except (ValueError, IndexError, KeyError, struct.error) as exc:
            if damaged is None:
                raise
            damaged[name] = f"{type(exc).__name__}: {exc}"
    return out


def scope_refusals(ledger: Ledger, names: Sequence[str]) -> int:
    """The refusals the named scopes counted, summed (one HGET each, pipelined)."""
    if not names:
        return 0
    ks = ledger.keyspace
    ledger.check_open()
    with translated(), ledger.client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hget(ks.scope(name).hash, schema.SCOPE_REFUSED)
        return sum(int(v) for v in pipe.execute() if v is not None and v.isdigit())
