"""The stored records with a type of their own: :class:`JobEntry` (a job stream entry),
:class:`DeadLetterEntry` (a dead-letter stream entry), :class:`SummaryRecord` (the JSON
``compact`` stores per summary), and the field names of an item and of its text
(:func:`item_field`, :func:`content_field`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ledger.models import JobKind
from ledger.schema.base import Field, fields
from ledger.schema.session_hash import ITEM
from ledger.schema.stores import (
    CONTENT,
    DEAD_ERROR,
    DEAD_JOB,
    DEAD_WHY,
    JOB_EPOCH,
    JOB_INC,
    JOB_KIND,
    JOB_OP,
    JOB_REASON,
    JOB_SESSION,
    SUMMARY_AT,
    SUMMARY_REPLACED,
    SUMMARY_TEXT,
    SUMMARY_TOKENS,
)


def content_field(code: str, item_id: str) -> str:
    """The field of an item's text in the content store, and the reference to an item in
    a summary's ``replaced`` and a compaction's drops: ``'<consumer code>:<item id>'``."""
    return CONTENT.of(code, item_id)


def item_field(code: str, item_id: str) -> str:
    """The session hash field of one item: ``'i:<consumer code>:<item id>'``."""
    return ITEM.of(code, item_id)


def text(v: object) -> str:
    """A value read from Redis (bytes or str, by the client's decode_responses) as str."""
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass(frozen=True, slots=True)
class JobEntry:
    """One entry of a partition's job stream (docs/protocol.md#the-job-stream), as the
    scripts write it (``enqueue`` in _common.lua)."""

    kind: JobKind
    session: str
    epoch: int
    reason: str = ""
    op: str = ""
    inc: int = 0

    def to_fields(self) -> dict[str, str]:
        """The stream entry's fields, in the order the scripts write them."""
        return {
            JOB_KIND.wire: self.kind.value,
            JOB_SESSION.wire: self.session,
            JOB_EPOCH.wire: str(self.epoch),
            JOB_REASON.wire: self.reason,
            JOB_OP.wire: self.op,
            JOB_INC.wire: str(self.inc),
        }

    @classmethod
    def from_fields(cls, fields: Mapping[Any, Any]) -> JobEntry:
        """An entry from its fields (bytes or str); a missing reason, op or inc is empty
        (0); a missing session or epoch raises KeyError, a missing or unknown kind or a
        bad number ValueError."""
        f = {text(k): text(v) for k, v in fields.items()}
        kind = f.get(JOB_KIND, "")
        if kind not in tuple(JobKind):
            raise ValueError(f"unknown job kind {kind!r}")
        return cls(
            kind=JobKind(kind),
            session=f[JOB_SESSION],
            epoch=int(f[JOB_EPOCH]),
            reason=f.get(JOB_REASON, ""),
            op=f.get(JOB_OP, ""),
            inc=int(f.get(JOB_INC) or 0),
        )


JOB_FIELDS: tuple[Field, ...] = tuple(fields("job"))


@dataclass(frozen=True, slots=True)
class DeadLetterEntry:
    """One entry of a partition's dead-letter stream: the fields of the job the worker
    gave up on, as it read them (perhaps not a well-formed :class:`JobEntry`: a malformed
    job is dead-lettered too), then its entry id, why, and its last recorded error."""

    fields: Mapping[str, str]
    job: str
    why: str
    error: str = ""

    def to_fields(self) -> dict[str, str]:
        """The stream entry's fields: the job's, then job, why and error (each of these
        three in the job's place if the job had a field of that name)."""
        return {
            **self.fields,
            DEAD_JOB.wire: self.job,
            DEAD_WHY.wire: self.why,
            DEAD_ERROR.wire: self.error,
        }

    @classmethod
    def from_fields(cls, fields: Mapping[Any, Any]) -> DeadLetterEntry:
        """An entry from its fields (bytes or str); a missing job, why or error is empty."""
        f = {text(k): text(v) for k, v in fields.items()}
        own = (DEAD_JOB, DEAD_WHY, DEAD_ERROR)
        job, why, error = (f.get(n, "") for n in own)
        return cls({k: v for k, v in f.items() if k not in own}, job, why, error)

    @property
    def kind(self) -> str:
        """The job's kind as written ('?' if it had none)."""
        return self.fields.get(JOB_KIND, "?")

    @property
    def session(self) -> str:
        """The job's session id as written ('?' if it had none)."""
        return self.fields.get(JOB_SESSION, "?")


@dataclass(frozen=True, slots=True)
class SummaryRecord:
    """What ``compact`` stores per summary in the summaries hash:
    ``{"text": <text>, "replaced": ["<c>:<id>", ...], "at": <ms>, "tokens": <n>}``
    (``tokens``: the count the ledger took, the compactor's; 0 when the record has none)."""

    text: str
    replaced: tuple[str, ...] = ()
    at: int = 0
    tokens: int = 0

    def to_json(self) -> str:
        return json.dumps(
            {
                SUMMARY_TEXT.wire: self.text,
                SUMMARY_REPLACED.wire: list(self.replaced),
                SUMMARY_AT.wire: self.at,
                SUMMARY_TOKENS.wire: self.tokens,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> SummaryRecord:
        """A record from its JSON; ValueError when it is not one (a missing ``at`` is 0:
        records written before it was stored have none)."""
        try:
            rec = json.loads(raw)
            return cls(
                str(rec[SUMMARY_TEXT]),
                tuple(str(r) for r in rec.get(SUMMARY_REPLACED, ())),
                int(rec.get(SUMMARY_AT, 0)),
                int(rec.get(SUMMARY_TOKENS, 0)),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a summary record: {raw!r:.200}") from exc

    def replaced_items(self) -> list[tuple[str, str]]:
        """``replaced`` as (consumer code, item id) pairs."""
        return [(code, iid) for code, _, iid in (r.partition(":") for r in self.replaced)]
