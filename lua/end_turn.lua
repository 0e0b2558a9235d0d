-- end_turn.lua: close a turn with its amplification ratio and class (docs/rules.md#amplification).
--
-- KEYS[1]  session hash
-- KEYS[2]  partition job stream    a compaction job is appended when one becomes pending
-- KEYS[3]  partition deadline index  the turn lease's member '<session>|~' is removed
-- KEYS[4]  content store           '<tag>:content:<session>' (deleted by a staged reset)
-- KEYS[5]  summaries               '<tag>:compacted:<session>' (deleted by a staged reset)
-- KEYS[6]  partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[7]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[8]  previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch[@turn]            integer; older than the session's -> LEDGER_STALE; @turn:
--                                  a call of that turn (see `fence`)
-- ARGV[3]  turn                    the current turn (as begin_turn returned it), 0..1e15
-- ARGV[4]  final prompt tokens     the prompt actually sent (the model's own count), 1..1e8
-- ARGV[5]  p99 trend               -1..1: -1 falling, 0 flat or unknown, 1 rising
-- ARGV[6]  session id              must name KEYS[1]
-- ARGV[7]  commit mark             the app state's version this turn commits (e.g. a
--                                  checkpoint id), [A-Za-z0-9._:/@+=#-]{1,128}; '-' keeps the last
--
-- Ending the turn commits it: its lease ends, its undo log and its deliveries are
-- dropped (docs/agent.md#turn-leases), and the mark is kept for the next begin_turn.
-- A hard reset staged while the turn was open (see reset.lua) applies then, after the
-- turn's commit: reset=<the new epoch> (empty: none applied).
-- ratio = sum of this turn's memory-tool span input tokens / final prompt tokens
-- (per mille). utilization = final prompt / window; its delta is against the
-- previous end_turn. Class, first match in this order:
--   pathological   ratio > pathological threshold, utilization falling, p99 rising
--   saturation     utilization rising and ratio < saturation threshold
--   fragmentation  ratio > fragmentation threshold
--   ambiguous      none of these
-- A compaction becomes due when occupancy is above the high-water mark.
-- Drift: the real prompt minus occupancy (system prompt + framing + items + open
-- reservations), stored with the prompt (fields dr, dp). It is flagged (field df,
-- counter x:drift) when the prompt is larger than the window ('over_window', judged
-- whatever the tolerance), or when |drift| is above the session's framing tolerance
-- ('drift'; a tolerance of -1 judges nothing). A flag stays until the next end_turn
-- or a reconcile; audit reports it.
--
-- Mode: mutating
-- Reply: status=ok|turn=<n>|ratio=<per mille>|class=<name>|utilization=<per mille>
--          |utilization_delta=<per mille>|spans=<n>|span_input=<tokens>|compaction_due=<0|1>
--          |rollup=<0|1>|epoch=<n>|occupancy=<tokens>|drift=<tokens>|tolerance=<tokens or -1>
--          |flag=<none|drift|over_window>|reset=<new epoch, or empty>
-- Errors: LEDGER_BADARG (a final prompt of 0), LEDGER_NOSESSION, LEDGER_STALE,
--         LEDGER_OPREUSED, LEDGER_TURNLOST (the turn is not open: ended, rolled back or
--         followed by another).
-- Calls: HMGET, TIME, HSET, HDEL, ZREM, HINCRBY (class; x:drift when flagged), HGET and XADD when a
--        compaction becomes pending (worker-owned sessions); HMGET of the op's outcome
--        bucket and the epoch base e, HSET of the bucket; a PEXPIRE, or the outcome
--        generations' RENAME and PEXPIRE, when due; with a staged reset HEXISTS, HGETALL,
--        HDEL, ZREM, HINCRBY, DEL and HSET (see `reset_effect`).

local op, fp, epoch = op_args('end_turn', false)
local turn, final, trend
turn = int_arg(ARGV[3], 'turn', 0, 1e15)
final = int_arg(ARGV[4], 'final prompt tokens', 1, TOKENS_MAX)
trend = int_arg(ARGV[5], 'p99 trend', -1, 1)
local sid, mark
sid = session_arg(ARGV[6])
mark = ARGV[7] == '-' and '-' or id_arg(ARGV[7], 'commit mark')
if #ARGV ~= 7 then fail('BADARG', 'expected 7 arguments, got ' .. #ARGV) end

key_arg(2, 'jobs', 'deadlines', 'content:%s', 'compacted:%s')
local key = KEYS[1]
local H, R = load(key, { 'ep', 'tn', 'W', 'S', 'T', 'a_w', 'a_rm', 'a_s', 'F_w', 'HW', 'cd', 'kt', 'rut', 'rup',
  'ai', 'an', 'pu', 'ams', 'amf', 'amp', 'gz', 'xp', 'te', 'dt', 'lo', 'rz' }, 24)
local again = gate(recorded(op), H.ep, op, fp, epoch)
if again then return again end
fence(key, R[1], H.tn, turn, true)
local now = now_ms()
local args = {}
local out = turn_end(key, H, H.a_s, final, trend, turn, mark, sid, op, args)
local st = reset_staged(R[2], H.ep)
out[#out + 1] = '|reset=' .. (st and (H.ep + 1) or '')
local reply = table.concat(out)
commit(key, now, op, fp, reply, args, { gz = H.gz, xp = H.xp })
reset_at_end(key, st, { KEYS[3], KEYS[4], KEYS[5] }, sid)
return reply
