"""What the ledger stores, defined once: every field of every hash and record.

Each :class:`Field` is a ``str`` equal to its wire name (the short name the Lua scripts
read and write: ``EPOCH == "ep"``), so Python reads a hash or a reply with it directly
(``n[schema.EPOCH]``) and carries its long name, unit, owner and meaning with it. The wire
names are the protocol (docs/protocol.md): renaming one is a protocol change, so this
module gives them long names and never changes them.

A wire name with ``<...>`` in it is a pattern: ``u_<c>`` is ``u_w``, ``u_r``, ``u_m`` and
``u_s`` (:data:`CONSUMERS`), ``x:<name>`` any telemetry counter. Letters have one meaning
each: a consumer letter ``<c>`` (:data:`CONSUMERS`) means that consumer wherever it
appears, in the per-consumer fields (``u_``, ``n_``, ``v_``, ``i:``, ``r:``'s record) and in
the fields of the three claim groups, spelled with the letters of the consumers each holds:
``a_w``/``F_w`` working memory, ``a_rm``/``F_rm`` the memory group (retrieval ``r`` and
recall ``m``), ``a_s`` scratchpad; named here ``..._working``, ``..._memory_group``,
``..._scratchpad``.

The Lua side gets the same definitions as the legend of ``_common.lua``, generated from
this module: ``python tools/legend.py`` writes it, ``--check`` exits 1 when it is
stale (run by ``.ci/run`` and tests/test_schema.py, which also fails on a field a script
or a Python module uses that is not defined here).

Four records have a type of their own here: :class:`JobEntry` (an entry of a
partition's job stream), :class:`DeadLetterEntry` (an entry of its dead-letter stream),
:class:`SummaryRecord` (the JSON the ``compact`` script stores per summary) and the
content store's field name (:func:`content_field`).

The worker's own records (the dead letters and the errors hash: :data:`WORKER_OWNERS`) are
defined here too, but no script reads or writes them, so the Lua legend leaves them out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ledger.models import JobKind

Unit = Literal[
    "tokens",
    "ms",
    "time",
    "count",
    "per_mille",
    "flag",
    "epoch",
    "turn",
    "id",
    "text",
    "binary",
    "version",
]
Owner = Literal[
    "session",
    "outcome",
    "tally",
    "job",
    "summary",
    "compacted",
    "content",
    "spill",
    "history",
    "dead_letter",
    "errors",
    "scope",
    "scope_holds",
]

# What each unit means, for the legend.
UNITS: dict[str, str] = {
    "tokens": "tokens",
    "ms": "a duration in ms",
    "time": "a time in ms on Redis's clock",
    "count": "a count",
    "per_mille": "per mille",
    "flag": "1 or 0",
    "epoch": "an epoch",
    "turn": "a turn number",
    "id": "an identifier (text)",
    "text": "text",
    "binary": "binary (control-character separated)",
    "version": "a version number (docs/protocol.md#versions)",
}

# Where each owner lives (docs/protocol.md#keys).
OWNERS: dict[str, str] = {
    "session": "the session hash '<tag>:s:<session>' (KEYS[1] of every session script)",
    "outcome": "the outcome hashes '<tag>:out:<session>' and '<tag>:old:<session>' (the "
    "current and previous generation; the last two KEYS of every mutating script)",
    "tally": "the partition's tally '<tag>:tally': each indicator counted in a session's "
    "'x:<name>' is counted here too, in the same step",
    "job": "an entry of the partition's job stream '<tag>:jobs' (written in this order)",
    "summary": "the JSON record of one summary, in the summaries hash",
    "compacted": "the summaries hash '<tag>:compacted:<session>'",
    "content": "the content store '<tag>:content:<session>'",
    "spill": "the spill hash '<tag>:spill:<session>'",
    "history": "the history hash '<tag>:history:<session>'",
    "dead_letter": "an entry of the partition's dead-letter stream '<tag>:dead' (written by "
    "the worker, ledger/workers/delivery.py): the job entry's fields as read, then these",
    "errors": "the worker's errors hash '<tag>:errors' (ledger/workers/delivery.py)",
    "scope": "a budget scope's hash '<tag>:t:<scope>' (docs/ceilings.md): a tenant, or a "
    "key or user within it, in the tenant's partition; quantities <q>: i input, o output, "
    "c cached input tokens, $ micro-cents",
    "scope_holds": "a budget scope's holds index '<tag>:th:<scope>' (sorted set)",
}
# The owners only the worker writes: no script touches them (not in the Lua legend).
WORKER_OWNERS: frozenset[str] = frozenset({"dead_letter", "errors"})

# The consumers' one-letter codes (ledger.models.Consumer.code): w working memory,
# r retrieval, m recall, s scratchpad.
CONSUMERS: dict[str, str] = {
    "w": "working memory",
    "r": "retrieval",
    "m": "recall",
    "s": "scratchpad",
}

_PLACEHOLDER = re.compile(r"<(\w+)>")
# What a placeholder stands for, where it is not any text.
_PLACES = {"c": "|".join(CONSUMERS), "bucket": "[0-9a-f]{2,4}"}


class Field(str):
    """One stored field: equal to its wire name, with its long name, unit, owner and
    meaning."""

    name: str
    unit: Unit
    owner: Owner
    meaning: str

    def __new__(cls, wire: str, name: str, unit: Unit, owner: Owner, meaning: str) -> Field:
        self = super().__new__(cls, wire)
        self.name, self.unit, self.owner, self.meaning = name, unit, owner, meaning
        return self

    @property
    def wire(self) -> str:
        return str.__str__(self)

    @property
    def pattern(self) -> bool:
        """Whether the wire name stands for several (``u_<c>``, ``x:<name>``)."""
        return "<" in self

    @property
    def opaque(self) -> bool:
        """Whether the whole name is data (``<bucket>``, ``<c>:<id>``): any name of its
        hash is one, so it is looked up only in a hash known to be its owner's."""
        return self.startswith("<")

    @property
    def prefix(self) -> str:
        """The literal start of a pattern (``u_`` of ``u_<c>``; the name itself otherwise)."""
        return self.wire.split("<", 1)[0]

    def of(self, *parts: str) -> str:
        """The wire name of a pattern with its placeholders filled in, in order:
        ``HELD.of("w") == "u_w"``, ``ITEM.of("w", "m1") == "i:w:m1"``."""
        it = iter(parts)
        out = _PLACEHOLDER.sub(lambda _: next(it), self.wire)
        if next(it, None) is not None:
            raise ValueError(f"too many parts for {self.wire}: {parts}")
        return out

    def matches(self, wire: str) -> bool:
        """Whether a concrete wire name is this field (or one this pattern stands for)."""
        if not self.pattern:
            return wire == self.wire
        rx = "".join(
            "(" + _PLACES.get(m.group(1), ".+") + ")" if m.group(1) else re.escape(m.group(0))
            for m in re.finditer(r"<(\w+)>|[^<]+", self.wire)
        )
        return re.fullmatch(rx, wire) is not None

    def __repr__(self) -> str:
        return f"Field({self.wire!r}, {self.name!r})"


FIELDS: list[Field] = []


def _f(wire: str, name: str, unit: Unit, owner: Owner, meaning: str) -> Field:
    f = Field(wire, name, unit, owner, meaning)
    FIELDS.append(f)
    return f


# --- the session hash -----------------------------------------------------------------


def _s(wire: str, name: str, unit: Unit, meaning: str) -> Field:
    return _f(wire, name, unit, "session", meaning)


LAYOUT = _s(
    "lv",
    "layout",
    "version",
    "the session's stored layout version, written by the open that created it (the "
    "scripts' LAYOUT; absent: 1); scripts refuse a layout they do not read (LEDGER_VERSION)",
)
EPOCH = _s(
    "ep",
    "epoch",
    "epoch",
    "the fence every call's ARGV[2] is checked against: a new "
    "incarnation starts at Redis's clock, each hard reset adds 1",
)
TURN = _s("tn", "turn", "turn", "the last turn begun (the open one while lo is set)")
SEQUENCE = _s("sq", "sequence", "count", "item sequence: each admitted item gets the next number")
ORDER_THROUGH = _s(
    "oq",
    "order_through",
    "count",
    "the reclaim-order index '<tag>:order:<session>' holds every scratchpad, retrieval "
    "and recall item while this equals sq (absent or other: rebuilt when next needed)",
)
ORDER_TTL_AT = _s(
    "ox",
    "order_ttl_at",
    "time",
    "when the reclaim-order index's TTL is next set: the first call adding to it after this "
    "sets it again (absent: now)",
)
INCARNATION = _s("inc", "incarnation", "time", "when this incarnation was created (a job's inc)")
PAST_EPOCH = _s("pe", "past_epoch", "epoch", "in a tombstone (a deleted session): its last epoch")
BUDGET_FINGERPRINT = _s("cfg", "budget_fingerprint", "text", "the budget's fingerprint (SHA-256)")
WINDOW = _s("W", "window", "tokens", "the context window")
SYSTEM_PROMPT = _s("S", "system_prompt", "tokens", "the system prompt")
TOOL_FRAMING = _s("T", "tool_framing", "tokens", "the tool framing")
OUTPUT_RESERVE = _s("out", "output_reserve", "tokens", "the output reserve of the current turn")
DEFAULT_OUTPUT_RESERVE = _s(
    "R0",
    "default_output_reserve",
    "tokens",
    "the budget's output reserve (what begin_turn with '-' takes)",
)
WORKING_FLOOR = _s("F_w", "floor_working", "tokens", "the working-memory group's floor")
MEMORY_FLOOR = _s(
    "F_rm", "floor_memory_group", "tokens", "the memory group's floor (retrieval + recall)"
)
SCRATCHPAD_FLOOR = _s(
    "F_s", "floor_scratchpad", "tokens", "never written: the scratchpad has no floor (read as 0)"
)
HIGH_WATER = _s("HW", "high_water_mark", "tokens", "the high-water mark")
EVICTION_THRESHOLD = _s("EV", "eviction_threshold", "tokens", "the eviction threshold")
FREE = _s(
    "fr",
    "free",
    "tokens",
    "W minus every claim (S, T, out, and per group the larger of "
    "its active tokens and its floor): kept exact by every script",
)
ACTIVE_WORKING = _s(
    "a_w",
    "active_working",
    "tokens",
    "active tokens (items + open reservations) of the working-memory group",
)
ACTIVE_MEMORY = _s(
    "a_rm",
    "active_memory_group",
    "tokens",
    "active tokens of the memory group (retrieval + recall)",
)
ACTIVE_SCRATCHPAD = _s("a_s", "active_scratchpad", "tokens", "active tokens of the scratchpad")
HELD = _s("u_<c>", "held", "tokens", "tokens held by consumer c's items")
ITEM_COUNT = _s("n_<c>", "item_count", "count", "consumer c's item count")
RESERVED = _s("v_<c>", "reserved", "tokens", "tokens held by consumer c's open reservations")
OPEN_RESERVATIONS = _s("nv", "open_reservations", "count", "open reservations")
IDLE_TTL = _s("ttl", "idle_ttl", "ms", "the session's idle TTL")
OP_RETENTION = _s("ort", "op_retention", "ms", "how long an outcome is kept")
TTL_REFRESH_AT = _s("xp", "ttl_refresh_at", "time", "when the keys' TTLs are next refreshed")
RELEASED_EACH_TURN = _s(
    "rel", "released_each_turn", "text", "consumers released at each begin_turn (letters, or '-')"
)
SPILL_PREVIEW = _s("pv", "spill_preview", "tokens", "a spilled tool result's preview")
SPILL_TTL = _s("sttl", "spill_ttl", "ms", "how long a spilled result is kept")
ESCALATE_AFTER = _s("cx", "escalate_after", "count", "failed compactions that escalate to a reset")
ROLLUP_TURNS = _s("rut", "rollup_turns", "count", "roll-up turns")
ROLLUP_SHARE = _s("rup", "rollup_share", "per_mille", "roll-up share")
AMP_SATURATION = _s(
    "ams", "amplification_saturation", "per_mille", "amplification threshold: saturation"
)
AMP_FRAGMENTATION = _s(
    "amf", "amplification_fragmentation", "per_mille", "amplification threshold: fragmentation"
)
AMP_PATHOLOGICAL = _s(
    "amp", "amplification_pathological", "per_mille", "amplification threshold: pathological"
)
AGENT_COMPACTS = _s(
    "ca", "agent_compacts", "flag", "1: the agent compacts (no compaction jobs), 0: the worker"
)
MIN_GAIN = _s("kg", "min_gain", "tokens", "a compaction's minimum gain")
COMPACTION_PENDING = _s("cd", "compaction_pending", "flag", "1 while a compaction is pending")
COMPACTION_REQUESTED_AT = _s(
    "cq",
    "compaction_requested_at",
    "time",
    "when the last compaction job was requested (its entry id)",
)
STAGED_COMPACTION = _s(
    "kp",
    "staged_compaction",
    "text",
    "a worker's compaction committed while a turn was open, landed by the next begin_turn "
    "(JSON: op, ep, id, t, items, text, read)",
)
FAILED_COMPACTIONS = _s("kf", "failed_compactions", "count", "consecutive failed compactions")
COMPACTIONS_DONE = _s("kn", "compactions_done", "count", "compactions done")
LAST_COMPACTION_TURN = _s("kt", "last_compaction_turn", "turn", "the turn of the last compaction")
RESET_REQUESTED = _s(
    "rq",
    "reset_requested",
    "flag",
    "1 once failed compactions escalated to a hard reset, until it is done",
)
MEMORY_SINCE_PENDING = _s(
    "pm",
    "memory_since_pending",
    "tokens",
    "memory-group tokens admitted since the pending compaction became pending",
)
WORKING_SET = _s("ws", "working_set", "tokens", "this turn's working set")
SPAN_INPUT = _s("ai", "span_input", "tokens", "this turn's memory-tool spans: input tokens")
SPAN_OUTPUT = _s("ao", "span_output", "tokens", "this turn's memory-tool spans: output tokens")
SPAN_COUNT = _s("an", "span_count", "count", "this turn's memory-tool spans: how many")
LAST_UTILIZATION = _s("pu", "last_utilization", "per_mille", "utilization at the last end_turn")
LAST_ENDED_TURN = _s("te", "last_ended_turn", "turn", "the last turn end_turn committed")
FRAMING_TOLERANCE = _s(
    "dt", "framing_tolerance", "tokens", "the framing tolerance (-1: drift not judged)"
)
DRIFT = _s("dr", "drift", "tokens", "the last end_turn's drift (its prompt less the occupancy)")
LAST_PROMPT = _s("dp", "last_prompt", "tokens", "the last end_turn's prompt")
DRIFT_FLAGGED = _s("df", "drift_flagged", "flag", "1 when the last end_turn's drift was flagged")
TURN_OWNER = _s(
    "lo", "turn_owner", "id", "the open turn's owner: a turn is open exactly while lo is set"
)
LEASE_UNTIL = _s("le", "lease_until", "time", "the end of the open turn's lease")
BEGUN_BY = _s(
    "lb",
    "begun_by",
    "id",
    "the op id of the begin_turn that opened the open turn "
    "(calls sent with it stamp '<epoch>@~<op id>')",
)
TURN_KEY = _s(
    "lk",
    "turn_key",
    "text",
    "the SHA-1 (hex) of the open turn's owner token: a call into the turn must carry the "
    "token (ARGV[2] '...!<token>'); absent: no call can prove the turn (begun by protocol 1)",
)
UNDO_LOG = _s(
    "ul",
    "undo_log",
    "binary",
    "the open turn's undo log: '\\31<field>\\30<value "
    "before>' per item or reservation field it changed, and 'out'",
)
TURN_OPS = _s(
    "uo", "turn_ops", "binary", "the open turn's op keys (the outcomes a rollback removes)"
)
QUEUED_SUMMARIES = _s(
    "qs", "queued_summaries", "text", "summary ids ('<id>,...') queued for the next turn"
)
QUEUED_DROPS = _s(
    "qd", "queued_drops", "text", "items to drop ('<c>:<id>,...') queued for the next turn"
)
DELIVERED_SUMMARIES = _s(
    "vs", "delivered_summaries", "text", "qs handed to the open turn (queued again on a rollback)"
)
DELIVERED_DROPS = _s(
    "vd", "delivered_drops", "text", "qd handed to the open turn (queued again on a rollback)"
)
COMMIT_MARK = _s("cm", "commit_mark", "id", "the commit mark the last end_turn recorded")
ROLLED_BACK = _s("rb", "rolled_back", "text", "the last rolled-back turn: '<turn> <why>'")
ROTATE_AT = _s("gz", "rotate_at", "time", "when the current outcome generation is rotated")
ITEM = _s("i:<c>:<id>", "item", "text", "one item: '<tokens>|<turn>|<priority>|<seq>'")
RESERVATION = _s(
    "r:<id>", "reservation", "text", "one open reservation: '<c>|<tokens>|<deadline ms>'"
)
CHILD_POOL = _s(
    "k:<id>",
    "child_pool",
    "text",
    "the children of open reservation <id>: '<floors>|<drawn past floors>|<children>'",
)
CHILD = _s("k:<id>|<child>", "child", "text", "one child of reservation <id>: '<floor>|<used>'")
LAST_RESET = _s("x:last_reset", "last_reset", "text", "the last reset's reason")
COUNTER = _s("x:<name>", "counter", "count", "a telemetry counter (only ever incremented)")

# --- the outcome hashes ---------------------------------------------------------------

BUCKET = _f(
    "<bucket>",
    "bucket",
    "binary",
    "outcome",
    "the outcomes of the op ids whose SHA-1 starts with these 2 (3, 4) hex digits: "
    "'\\30<key><fingerprint><coded reply>' each",
)
EPOCH_BASE = _f(
    "e",
    "epoch_base",
    "epoch",
    "outcome",
    "the generation's epoch base: the epoch of its first outcome",
)
OUTCOMES = _f("k", "outcomes", "count", "outcome", "the outcomes the generation holds")
HAD_PREVIOUS = _f(
    "g", "had_previous", "flag", "outcome", "0: the generation began when no previous one existed"
)

# --- the partition's tally ------------------------------------------------------------

INDICATORS = (
    "drift", "reconciled", "refused", "refused_pending", "expired", "spilled", "starvation",
    "loud", "failed_compactions", "escalations", "resets", "rolled_back", "evicted_memory",
    "fanout_refused", "refused_ceiling", "refused_child",
)  # fmt: skip
for _name in INDICATORS:
    _f(_name, "tally_" + _name, "count", "tally", f"indicator {_name} (docs/operations.md)")
AMP_CLASS = _f(
    "class:<class>", "tally_class", "count", "tally", "ended turns of one amplification class"
)

# --- a job stream entry ---------------------------------------------------------------

JOB_KIND = _f("kind", "kind", "text", "job", "compact or hard_reset")  # ledger.models.JobKind
JOB_SESSION = _f("session", "session", "id", "job", "the session id")
JOB_EPOCH = _f("epoch", "epoch", "epoch", "job", "the session's epoch when the job was written")
JOB_REASON = _f("reason", "reason", "text", "job", "why the job was written")
JOB_OP = _f("op", "op", "id", "job", "the op id of the call that wrote the job")
JOB_INC = _f("inc", "incarnation", "time", "job", "the session's inc, 0 if unknown")

# --- the summaries, content, spill and history hashes ---------------------------------

SUMMARY_TEXT = _f("text", "text", "text", "summary", "the summary's text")
SUMMARY_REPLACED = _f(
    "replaced", "replaced", "text", "summary", "the items it replaced: ['<c>:<id>', ...]"
)
SUMMARY_AT = _f("at", "at", "time", "summary", "when the compact that stored it ran")
SUMMARY_TOKENS = _f(
    "tokens", "tokens", "tokens", "summary", "the summary's tokens as its compactor counted them"
)
SUMMARY = _f("<summary_id>", "summary", "text", "compacted", "a SummaryRecord (JSON)")
COMPACTING = _f(
    "~",
    "compacting",
    "text",
    "compacted",
    "'<worker>|<until ms>' while a worker computes the session's compaction",
)
CONTENT = _f("<c>:<id>", "content", "text", "content", "an item's text (see content_field)")
SPILLED = _f("<call_id>", "spilled", "text", "spill", "a spilled tool result's content")
HISTORY = _f("<version>", "history", "text", "history", "a JSON list of the conversation's items")

# --- the worker's dead letters and errors hash -----------------------------------------

DEAD_JOB = _f(
    "job", "job", "id", "dead_letter", "the entry id the job had in the partition's job stream"
)
DEAD_WHY = _f(
    "why",
    "why",
    "text",
    "dead_letter",
    "why the worker gave up on it ('delivered <n> times'; a compaction's adds '; counted "
    "as a failed compaction (<outcome>)')",
)
DEAD_ERROR = _f(
    "error",
    "error",
    "text",
    "dead_letter",
    "the job's last recorded error (its field of the errors hash), empty if none",
)
JOB_ERROR = _f(
    "<entry_id>",
    "job_error",
    "text",
    "errors",
    "the last error (repr, at most 500 characters) of a job that failed and will be "
    "retried, by its entry id: removed when the job is done or dead-lettered",
)

# --- a budget scope (docs/ceilings.md) -----------------------------------------------


def _t(wire: str, name: str, unit: Unit, meaning: str) -> Field:
    return _f(wire, name, unit, "scope", meaning)


# Layout 2 kept the config in fields of their own: set_scope moves them into cf and removes
# them (a script of protocol 2, which reads 'L', then finds no scope: LEDGER_NOSCOPE).
SCOPE_WINDOW = _t("L", "scope_window", "ms", "layout 2's window length (into cf)")
SCOPE_BUCKET = _t("G", "scope_bucket", "ms", "layout 2's bucket length (into cf)")
SCOPE_HOLD_LIMIT = _t("hl", "scope_hold_limit", "ms", "layout 2's hold limit (into cf)")
SCOPE_COUNTED = _t("k", "counted", "text", "layout 2's kinds c_t counts (into cf)")
SCOPE_OP = _t("op", "scope_set_by", "id", "the op id of the set_scope that set it")
SCOPE_PRICE = _t(
    "p:<model>",
    "price",
    "text",
    "'<input>|<output>|<cached input>' cents per million tokens ('p:*': any other model)",
)
SCOPE_BUCKETS = _t("bl", "buckets", "text", "the buckets kept before the live one ('<bucket>,...')")
SCOPE_CONFIG = _t(
    "cf",
    "scope_config",
    "binary",
    "the config, packed (struct '<8qB': little-endian 8-byte integers, then one byte): the "
    "window L and bucket G (ms; a window is L/G buckets: one fixed, more rolling), the hold "
    "limit (ms), the ceilings input, output, cached input, tokens, money (micro-cents; -1: "
    "none), and the kinds the tokens ceiling counts as bits (1 input, 2 output, 4 cached)",
)
SCOPE_LIVE = _t(
    "w",
    "live",
    "binary",
    "the live bucket and its counters, packed (struct '<7q'): the bucket (now // G; -1: "
    "none), what it charged of input, output, cached input and money, its open holds, and a "
    "time no open hold's deadline is earlier than",
)
# Layout 2 kept the live bucket in fields of their own: set_scope moves them into w.
SCOPE_LIVE_BUCKET_V2 = _t("wb", "live_bucket", "count", "layout 2's live bucket (into w)")
SCOPE_LIVE_V2 = _t("w<q>", "live_charged", "count", "layout 2's live counter of q (into w)")
SCOPE_LIVE_OPEN_V2 = _t("wn", "live_open_holds", "count", "layout 2's live open holds (into w)")
SCOPE_NEXT_DEADLINE_V2 = _t("nd", "next_deadline", "time", "layout 2's next deadline (into w)")
SCOPE_CHARGED = _t(
    "<bucket>:<q>",
    "charged",
    "count",
    "what bucket <bucket> (now // G), once not live, charged of quantity q: open holds and "
    "billed usage",
)
SCOPE_USED = _t("<bucket>:u<q>", "billed", "count", "what bucket <bucket> billed of quantity q")
SCOPE_BUCKET_OVER = _t(
    "<bucket>:xt",
    "bucket_over",
    "tokens",
    "tokens bucket <bucket>'s settles billed past their holds",
)
SCOPE_BUCKET_OVER_MONEY = _t(
    "<bucket>:x$", "bucket_over_money", "count", "micro-cents billed past holds in bucket <bucket>"
)
SCOPE_OPEN = _t("<bucket>:n", "open_holds", "count", "bucket <bucket>'s open holds")
SCOPE_HOLD = _t(
    "q:<session>|<id>",
    "hold",
    "text",
    "an open hold: '<bucket>|<i>|<o>|<c>|<$>|<price i>|<price o>|<price c>|<scopes>'",
)
SCOPE_REFUSED = _t("nr", "scope_refused", "count", "reservations this scope refused")
SCOPE_OVER = _t("ot", "scope_over", "tokens", "tokens settles billed past their holds")
SCOPE_OVER_MONEY = _t(
    "om", "scope_over_money", "count", "micro-cents settles billed past their holds"
)
SCOPE_HOLD_DEADLINE = _f(
    "<session>|<id>",
    "hold_deadline",
    "time",
    "scope_holds",
    "member: an open hold, scored by its deadline",
)

# The names snapshot answers that no hash stores (docs/protocol.md#snapshot).
SNAPSHOT_NOW = "now"
SNAPSHOT_COMPACTING = "kw"
REPLY_ONLY = frozenset({SNAPSHOT_NOW, SNAPSHOT_COMPACTING})


def fields(owner: str | None = None) -> Iterator[Field]:
    """The defined fields, in definition order (of one owner when given)."""
    return (f for f in FIELDS if owner is None or f.owner == owner)


def lookup(wire: str, owner: str | None = None) -> Field | None:
    """The field a concrete wire name is (an exact name before a pattern), or None.
    Without an owner, an opaque field (any name of its hash) is not a candidate."""
    candidates = list(fields(owner))
    for f in candidates:
        if not f.pattern and f.wire == wire:
            return f
    patterns = (f for f in candidates if f.pattern and (owner or not f.opaque))
    return next((f for f in patterns if f.matches(wire)), None)


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


# --- the Lua legend -------------------------------------------------------------------

BEGIN = "-- BEGIN SCHEMA LEGEND (generated from ledger/schema.py by `python tools/legend.py`)"
END = "-- END SCHEMA LEGEND"


def _wrap(text: str, width: int) -> list[str]:
    lines, cur = [], ""
    for word in text.split():
        if cur and len(cur) + 1 + len(word) > width:
            lines.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    return [*lines, cur]


def legend() -> str:
    """The legend block of _common.lua: every field the scripts may touch (of an owner
    not in :data:`WORKER_OWNERS`), by owner, markers included."""
    out = [BEGIN]
    consumers = ", ".join(f"{c} {n}" for c, n in CONSUMERS.items())
    out += [f"-- {line}" for line in _wrap(
        f"Consumer letters <c> (a letter means a consumer only): {consumers}. The claim "
        "groups are named by their consumers' letters: a_w/F_w working memory, a_rm/F_rm the "
        "memory group (retrieval r + recall m), a_s scratchpad (no floor: "
        "F_s is never written). Units: " + "; ".join(f"{k} = {v}" for k, v in UNITS.items())
        + ".", 86)]  # fmt: skip
    for owner, where in OWNERS.items():
        if owner in WORKER_OWNERS:
            continue
        out.append("--")
        out += [f"-- {line}" for line in _wrap(f"{owner}: {where}", 86)]
        for f in fields(owner):
            text = _wrap(f"{f.name} [{f.unit}]: {f.meaning}", 70)
            out.append(f"--   {f.wire:<14} {text[0]}")
            out += [f"--   {'':<14} {line}" for line in text[1:]]
    out.append(END)
    return "\n".join(out) + "\n"


def with_legend(source: str) -> str:
    """``source`` (the text of _common.lua) with its legend block replaced by
    :func:`legend`; ValueError when it has no markers."""
    start, end = source.find(BEGIN.split(" (", 1)[0]), source.find(END)
    if start < 0 or end < start:
        raise ValueError(f"_common.lua has no legend markers ({BEGIN!r} ... {END!r})")
    return source[:start] + legend() + source[end + len(END) + 1 :]
