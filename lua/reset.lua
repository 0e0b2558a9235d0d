-- reset.lua: hard reset of a session: advance the epoch and drop every item and
-- reservation, keeping the budget (system prompt, framing and floors); the
-- compaction state (pending, consecutive failures, escalation) starts over, and
-- nothing is left to deliver: the app's state must start over too (see `reset_effect`).
--
-- An open turn is not cut off while it may still end (docs/rules.md#a-reset-waits-for-the-turns-end):
-- with a wait above 0, a reset that finds a turn open with its lease live is staged (field
-- rz: its epoch, when it is due, the call's fingerprint and op id, the reason; nothing
-- else written), and the call that ends the turn (end_turn, finish_turn, abort_turn, or
-- the begin_turn that ends it or takes it over) applies it after the turn's own effects,
-- its reply saying so (reset=<new epoch>). A staged reset is due `wait` ms after it was
-- staged: a reset call from then on applies it whatever is open (the turn ends with it:
-- its lease and its calls' epoch are gone). A wait of 0 applies the reset at once, an open
-- turn ending with it. A staged reply is not stored as the op's outcome: the same call sent
-- again is judged again (staged, applied once due, LEDGER_STALE once a turn's end applied
-- it), and a reset of the same epoch staged already keeps the first (its reason, its due
-- time).
--
-- KEYS[1]  session hash
-- KEYS[2]  partition deadline index
-- KEYS[3]  content store           '<tag>:content:<session>' (deleted: no item is left)
-- KEYS[4]  summaries               '<tag>:compacted:<session>' (deleted: nothing to deliver)
-- KEYS[5]  partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[6]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[7]  previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch                   the epoch being reset; older -> LEDGER_STALE (a reset
--                                  job delivered twice applies once)
-- ARGV[3]  session id
-- ARGV[4]  reason                  [A-Za-z0-9._:/@+=#-]{1,128}, kept in x:last_reset
-- ARGV[5]  wait                    ms a reset may wait for an open turn's end, 0..86400000;
--                                  0: applied now
--
-- Mode: mutating
-- Reply: status=ok|epoch=<new epoch>|dropped=<items>|released=<tokens>
--    or  status=staged|epoch=<epoch>|turn=<the open turn>|due=<ms, Redis's clock>
--   staged: the reset waits for the open turn's end; due: from then on a reset call applies it.
-- Errors: LEDGER_BADARG, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED.
-- Calls: HMGET, HGETALL, TIME, HDEL, ZREM, HSET, HINCRBY, DEL.

local op, fp, epoch = op_args('reset', false)
local sid, reason, wait
sid = session_arg(ARGV[3])
reason = id_arg(ARGV[4], 'reason')
wait = int_arg(ARGV[5], 'wait', 0, 86400000)
if #ARGV ~= 5 then fail('BADARG', 'expected 5 arguments, got ' .. #ARGV) end
key_arg(2, 'deadlines', 'content:%s', 'compacted:%s')
local key = KEYS[1]
local H, R = load(key, { 'ep', 'tn', 'le', 'gz', 'xp', 'lo', 'rz' }, 5)
local again = gate(recorded(op), H.ep, op, fp, epoch)
if again then return again end
local now = now_ms()
local st = reset_staged(R[2], H.ep)
if st and st.op == op and st.fp ~= fp then
  fail('OPREUSED', 'operation id ' .. op .. ' was already used with other arguments')
end
if R[1] and wait > 0 and (H.le or 0) > now then
  if not st then
    st = { due = now + wait, reason = reason }
    redis.call('HSET', key, 'rz', string.format('%d|%d|%s|%s|%s', H.ep, st.due, fp, op, reason))
  end
  if now < st.due then
    return reply({ 'status=staged', 'epoch=' .. H.ep, 'turn=' .. H.tn, 'due=' .. string.format('%d', st.due) })
  end
end
local args = {}
local e, dropped, released = reset_effect(key, { KEYS[2], KEYS[3], KEYS[4] }, sid, st and st.reason or reason, args)
return commit(key, now, op, fp, reply({ 'status=ok', 'epoch=' .. e, 'dropped=' .. dropped,
  'released=' .. released }), args, { gz = H.gz, xp = H.xp })
