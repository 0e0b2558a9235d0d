"""Key layout: every key the ledger writes is named here and nowhere else.

A session lives in one partition, ``crc32(session_id) % partitions``. The
partition is the hash tag of the session's keys and of the partition-wide
structures (the reservation deadline index), so one script can touch all of
them on Redis Cluster::

    <prefix>:{p<N>}:s:<session_id>     session hash (see lua/_common.lua)
    <prefix>:{p<N>}:out:<session_id>   outcome hash, buckets of stored replies by the
                                       SHA-1 of the op id: the current generation (see
                                       lua/_common.lua)
    <prefix>:{p<N>}:old:<session_id>   outcome hash of the previous generation
    <prefix>:{p<N>}:deadlines          sorted set of reservation deadlines (ms),
                                       members '<session_id>|<reservation_id>', and
                                       of turn lease ends, members '<session_id>|~'
    <prefix>:{p<N>}:jobs               stream of jobs for the workers (hard resets)
    <prefix>:{p<N>}:tally              hash indicator name -> how often the partition's
                                       sessions counted it, ever: kept by the scripts in
                                       the step that counts (the session's 'x:<name>'
                                       grows with it), read by the worker that exports
                                       the fleet's indicators; no TTL
    <prefix>:{p<N>}:dead               stream of the jobs the workers gave up on: each the
                                       job's fields, then 'job', 'why', 'error' (see
                                       ledger.schema.DeadLetterEntry)
    <prefix>:{p<N>}:errors             hash job entry id -> the last error of a job that
                                       failed and will be retried (the workers')
    <prefix>:{p0}:observer             the lease of the worker that keeps the fleet's
                                       indicators (its consumer name, with a TTL)
    <prefix>:{p<N>}:spill:<session_id>
                                       hash tool-call id -> a spilled tool result's content
    <prefix>:{p<N>}:spilled:<session_id>
                                       sorted set of the spilled results' call ids, scored
                                       by when each stops being readable (ms, Redis's
                                       clock); both keys live one spill TTL past the last
                                       spill, and a spill removes the results past theirs
    <prefix>:{p<N>}:content:<session_id>
                                       hash '<consumer code>:<item id>' -> the item's text,
                                       written by the scripts that admit it when the caller
                                       sends texts (the agent layer, for the worker's
                                       compactor); the session's idle TTL
    <prefix>:{p<N>}:history:<session_id>
                                       hash version -> JSON list of the conversation's
                                       items, for frameworks whose history the ledger
                                       keeps (the Agents SDK's governed Session): the
                                       version the last ended turn committed (its mark)
                                       and the one the open turn wrote; the session's TTL
    <prefix>:{p<N>}:compacted:<session_id>
                                       hash summary item id -> JSON {"text", "replaced",
                                       "at"}: the texts of the worker's summaries (written
                                       by the compaction that commits them), for the turn
                                       they are delivered to; field '~':
                                       '<worker>|<until ms>' while a worker computes the
                                       session's compaction; the session's TTL
    <prefix>:{p<N>}:order:<session_id>
                                       sorted set, the reclaim-order index: member
                                       'i:<c>:<id>' per scratchpad, retrieval and recall
                                       item, scored by consumer then sequence, and '~'
                                       once built (see ORDER in lua/_common.lua);
                                       the session's idle TTL. Kept by the calls that
                                       send it; a turn builds it again when it is not
                                       complete: it is never the truth, only an order

A session of a tenant is named '@<tenant>/<id>' (docs/ceilings.md): its partition is
the tenant's, ``crc32(tenant) % partitions``, so that the session and every budget scope
of its tenant share one hash tag and one script can hold a model call's cost in all of
them. A tenant's scopes (the tenant, or '<tenant>/<name>' for a key or user within it):

    <prefix>:{p<N>}:t:<scope>          hash: the scope's window, ceilings and price table,
                                       its counters per bucket and its open holds
    <prefix>:{p<N>}:th:<scope>         sorted set of the scope's open holds by deadline
                                       (ms, Redis's clock), members '<session>|<reservation>'

Deleting a session deletes its content, spill, compacted and history keys with it, and its
reclaim-order index; a new incarnation of an id starts with none (a new session builds its
index at its first turn that needs it, whatever an earlier one left).

No two (prefix, session, id) triples name the same key. Ids never contain '|' or
braces, so '|' ends a session id wherever another id follows it; a prefix never
contains braces, so the first '{p<N>}' is the hash tag and ends the prefix.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

from ledger.errors import InvalidArgument

_SESSION_RE = re.compile(r"[A-Za-z0-9._:/@+=#-]{1,128}")
_PREFIX_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_TENANT_RE = re.compile(r"[A-Za-z0-9._:=#+-]{1,64}")
_OF_TENANT = re.compile(r"@([A-Za-z0-9._:=#+-]{1,64})/.")


def tenant_of(session_id: str) -> str | None:
    """The tenant a session id names ('@<tenant>/<id>'), or None."""
    m = _OF_TENANT.match(session_id)
    return m.group(1) if m else None


def check_scope(name: object) -> str:
    """A budget scope's name checked: a tenant, or '<tenant>/<name>' within it (at most
    128 characters of a session id's). Returns the tenant."""
    tenant, sep, rest = name.partition("/") if isinstance(name, str) else ("", "", "")
    if (
        not _TENANT_RE.fullmatch(tenant)
        or (sep and not _SESSION_RE.fullmatch(rest))
        or len(str(name)) > 128
    ):
        raise InvalidArgument(
            "a scope is a tenant (1-64 characters of [A-Za-z0-9._:=#+-]) or "
            f"'<tenant>/<name>' within it, got {name!r}"
        )
    return tenant


@dataclass(frozen=True, slots=True)
class ScopeKeys:
    """The two keys of a budget scope: its hash and its holds index."""

    name: str
    tenant: str
    partition: int
    hash: str
    holds: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionKeys:
    session_id: str
    partition: int
    session: str
    deadlines: str
    jobs: str
    tally: str
    spills: str
    spilled: str
    content: str
    compacted: str
    history: str
    order: str
    outcomes: str
    outcomes_old: str

    @property
    def data(self) -> tuple[str, str, str, str, str]:
        """The keys that hold the session's data beside its hash: content, summaries,
        history, spills and their index (what delete and a new incarnation clear)."""
        return (self.content, self.compacted, self.history, self.spills, self.spilled)


@dataclass(frozen=True, slots=True)
class KeySpace:
    """Names keys for one prefix (tenant) and a fixed number of partitions."""

    prefix: str = "ledger"
    partitions: int = 64

    def __post_init__(self) -> None:
        if not _PREFIX_RE.fullmatch(self.prefix):
            raise InvalidArgument(
                f"key prefix must be 1-64 characters of [A-Za-z0-9._:-], got {self.prefix!r}"
            )
        if not 1 <= self.partitions <= 16384:
            raise InvalidArgument(f"partitions must be 1..16384, got {self.partitions}")

    def partition_of(self, session_id: str) -> int:
        """A session's partition: its tenant's for '@<tenant>/<id>', else its id's."""
        tenant = tenant_of(session_id)
        if tenant is not None:
            return self.tenant_partition(tenant)
        return zlib.crc32(session_id.encode()) % self.partitions

    def tenant_partition(self, tenant: str) -> int:
        return zlib.crc32(tenant.encode()) % self.partitions

    def scope(self, name: str) -> ScopeKeys:
        """A budget scope's keys: the tenant '<tenant>', or '<tenant>/<name>' within it,
        in the tenant's partition."""
        tenant = check_scope(name)
        p = self.tenant_partition(tenant)
        tag = self.tag(p)
        return ScopeKeys(name, tenant, p, f"{tag}:t:{name}", f"{tag}:th:{name}")

    def tag(self, partition: int) -> str:
        return f"{self.prefix}:{{p{partition}}}"

    def deadlines(self, partition: int) -> str:
        return f"{self.tag(partition)}:deadlines"

    def jobs(self, partition: int) -> str:
        return f"{self.tag(partition)}:jobs"

    def tally(self, partition: int) -> str:
        """The partition's indicator counts (a hash the scripts keep, see
        lua/_common.lua)."""
        return f"{self.tag(partition)}:tally"

    def dead_letters(self, partition: int) -> str:
        """The stream of the partition's jobs the workers gave up on."""
        return f"{self.tag(partition)}:dead"

    def job_errors(self, partition: int) -> str:
        """The hash job entry id -> the last error of a job of the partition that failed
        and will be retried (ledger.schema.JOB_ERROR), kept by the workers."""
        return f"{self.tag(partition)}:errors"

    def observer(self) -> str:
        """The lease of the one worker that keeps the fleet's indicators (a string: the
        holder's consumer name, with a TTL), under partition 0's tag."""
        return f"{self.tag(0)}:observer"

    def session(self, session_id: str) -> SessionKeys:
        if not isinstance(session_id, str) or not _SESSION_RE.fullmatch(session_id):
            raise InvalidArgument(
                "session id must be 1-128 characters of [A-Za-z0-9._:/@+=#-] "
                f"(no braces, which would break hash-tag routing), got {session_id!r}"
            )
        p = self.partition_of(session_id)
        tag = self.tag(p)
        return SessionKeys(
            session_id=session_id,
            partition=p,
            session=f"{tag}:s:{session_id}",
            deadlines=self.deadlines(p),
            jobs=self.jobs(p),
            tally=self.tally(p),
            spills=f"{tag}:spill:{session_id}",
            spilled=f"{tag}:spilled:{session_id}",
            content=f"{tag}:content:{session_id}",
            compacted=f"{tag}:compacted:{session_id}",
            history=f"{tag}:history:{session_id}",
            order=f"{tag}:order:{session_id}",
            outcomes=f"{tag}:out:{session_id}",
            outcomes_old=f"{tag}:old:{session_id}",
        )

    def session_key_parts(self, key: str) -> tuple[int, str] | None:
        """The partition and the session id in a session hash's key name, whatever
        partition count named it, or None for any other key."""
        m = re.fullmatch(rf"{re.escape(self.prefix)}:\{{p(\d+)\}}:s:(.+)", key)
        return (int(m.group(1)), m.group(2)) if m else None

    def session_id_of(self, key: str) -> str | None:
        """The session id in a session hash's key name, or None for any other key."""
        parts = self.session_key_parts(key)
        return parts[1] if parts else None

    def owns(self, key: str) -> bool:
        """Whether ``key`` is the session hash of one of this key space's sessions, in
        the partition its id maps to."""
        sid = self.session_id_of(key)
        return (
            sid is not None
            and _SESSION_RE.fullmatch(sid) is not None
            and (self.tag(self.partition_of(sid)) + ":s:" + sid == key)
        )

    def owns_scope(self, key: str) -> bool:
        """Whether ``key`` is the hash of a budget scope of this key space, in its
        tenant's partition."""
        m = re.fullmatch(rf"{re.escape(self.prefix)}:\{{p(\d+)\}}:t:(.+)", key)
        if not m:
            return False
        try:
            return self.scope(m.group(2)).hash == key
        except InvalidArgument:
            return False

    def scope_name_of(self, key: str) -> str | None:
        """The scope a budget scope's hash key names (in its tenant's partition), or
        None for any other key."""
        m = re.fullmatch(rf"{re.escape(self.prefix)}:\{{p(\d+)\}}:t:(.+)", key)
        return m.group(2) if m and self.owns_scope(key) else None

    def scope_pattern(self, tenant: str | None = None) -> str:
        """SCAN pattern matching every budget scope's hash of this prefix, or only those
        in a tenant's partition whose name starts with the tenant's (its own and its keys',
        and those of a tenant whose name it starts: filter with ``scope_name_of``)."""
        if tenant is None:
            return f"{self.prefix}:{{p*}}:t:*"
        check_scope(tenant)
        return f"{self.tag(self.tenant_partition(tenant))}:t:{tenant}*"

    def session_pattern(self) -> str:
        """SCAN pattern matching every session hash of this prefix."""
        return f"{self.prefix}:{{p*}}:s:*"
