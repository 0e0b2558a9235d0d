"""The fields of the session hash '<tag>:s:<session>' (KEYS[1] of every session script)."""

from __future__ import annotations

from ledger.schema.base import Field, Unit, _f


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
DEFERRED_COMPACTION = _s(
    "kr",
    "last_compaction_deferred",
    "count",
    "the failed-compaction count (kf) a deferral left (applied, occupancy at or under the "
    "high-water mark, less than the minimum gain): equal to kf while that deferral is the "
    "last compaction judged; 0 after any other outcome or a reset",
)
COMPACTIONS_DONE = _s("kn", "compactions_done", "count", "compactions done")
LAST_COMPACTION_TURN = _s("kt", "last_compaction_turn", "turn", "the turn of the last compaction")
RESET_REQUESTED = _s(
    "rq",
    "reset_requested",
    "flag",
    "1 once failed compactions escalated to a hard reset, until it is done",
)
STAGED_RESET = _s(
    "rz",
    "staged_reset",
    "text",
    "a hard reset that found a turn open with its lease live, applied by the call that "
    "ends the turn, or by a reset call once due: '<epoch>|<due ms>|<fingerprint>|<op "
    "id>|<reason>' (docs/rules.md#a-reset-waits-for-the-turns-end)",
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
