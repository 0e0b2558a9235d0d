-- reset.lua: hard reset of a session: advance the epoch and drop every item and
-- reservation, keeping the budget (system prompt, framing and floors); the
-- compaction state (pending, consecutive failures, escalation) starts over. An open
-- turn ends with it (its lease and its calls' epoch are gone), and nothing is left to
-- deliver: the app's state must start over too.
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
--
-- Mode: mutating
-- Reply: status=ok|epoch=<new epoch>|dropped=<items>|released=<tokens>
-- Errors: LEDGER_BADARG, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED.
-- Calls: HMGET, HGETALL, TIME, HDEL, ZREM, HSET, HINCRBY, DEL.

local op, fp, epoch = op_args('reset', false)
local sid, reason = sid_and_id('reason', 'content:%s', 'compacted:%s')
local key = KEYS[1]
local H, R = load(key, { 'ep', 'tn', 'W', 'S', 'T', 'out', 'F_w', 'F_rm', 'gz', 'xp', 'lo', 'qs', 'qd' }, 10)
local again = gate(recorded(op), H.ep, op, fp, epoch)
if again then return again end
local now = now_ms()
local fr = free_room(H, H.out, 0, 0, 0)  -- (before the first write: it reads every floor)
local all = redis.call('HGETALL', key)
local dead, members, dropped, released = {}, {}, 0, 0
for i = 1, #all, 2 do
  local f = all[i]
  local kind = string.sub(f, 1, 2)
  if kind == 'i:' then
    dead[#dead + 1] = f
    dropped = dropped + 1
    released = released + tonumber(string.match(all[i + 1], '^(%d+)|'))
  elseif kind == 'r:' then
    dead[#dead + 1] = f
    members[#members + 1] = sid .. '|' .. string.sub(f, 3)
    released = released + tonumber(string.match(all[i + 1], '^%a|(%d+)|'))
  end
end
-- (only fields that exist: a script's first write decides whether it may run on a
-- server out of memory, and resetting an empty session must not bypass that check)
if R[1] then for _, f in ipairs({ 'lo', 'le', 'lb', 'lk', 'ul', 'vs', 'vd', 'uo' }) do dead[#dead + 1] = f end end
if R[2] then dead[#dead + 1] = 'qs' end
if R[3] then dead[#dead + 1] = 'qd' end
for i = 1, #dead, 1000 do redis.call('HDEL', key, unpack(dead, i, math.min(i + 999, #dead))) end
if R[1] then members[#members + 1] = sid .. '|' .. LEASE end
call_each('ZREM', KEYS[2], members)
indicate(key, 'resets', 1)
redis.call('DEL', KEYS[3], KEYS[4])  -- (after a write that may be refused on a full server)
local args = { 'ep', H.ep + 1, 'fr', fr, 'nv', 0,
  'a_w', 0, 'a_rm', 0, 'a_s', 0, 'x:last_reset', reason, 'cd', 0, 'kf', 0, 'kr', 0, 'rq', 0, 'kt', H.tn,
  'ai', 0, 'ao', 0, 'an', 0, 'df', 0, 'dr', 0 }
zero_counters(args)
if R[1] then args[#args + 1], args[#args + 2] = 'rb', H.tn .. ' reset' end  -- (its calls: TURNLOST)
return commit(key, now, op, fp, reply({ 'status=ok', 'epoch=' .. (H.ep + 1), 'dropped=' .. dropped,
  'released=' .. released }), args, { gz = H.gz, xp = H.xp })
