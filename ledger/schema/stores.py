"""The fields of the other stores: the outcome hashes, the partition's tally, a job stream
entry, the summaries, content, spill and history hashes, the worker's dead letters and
errors hash, a budget scope and its holds index; and the names only snapshot answers."""

from __future__ import annotations

from ledger.schema.base import Field, Unit, _f

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
SNAPSHOT_RESET_DUE = "rzd"  # a staged reset (rz): when it is due (0: none)
SNAPSHOT_RESET_REASON = "rzr"  # and why (empty: none)
REPLY_ONLY = frozenset(
    {SNAPSHOT_NOW, SNAPSHOT_COMPACTING, SNAPSHOT_RESET_DUE, SNAPSHOT_RESET_REASON}
)
