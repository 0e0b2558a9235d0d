-- delete.lua: delete a session, its data (texts, summaries, history, spilled results) and
-- its reservations' and turn lease's index entries.
--
-- KEYS[1]  session hash
-- KEYS[2]  partition deadline index
-- KEYS[3..7]  the session's data   '<tag>:content:<session>', '<tag>:compacted:<session>',
--                                  '<tag>:history:<session>', '<tag>:spill:<session>',
--                                  '<tag>:spilled:<session>' (deleted)
-- KEYS[8]  (optional) reclaim-order index  '<tag>:order:<session>' (deleted)
-- KEYS[-3] partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[-2] outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[-1] previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch or '*'            '*' deletes whatever the epoch (operators)
-- ARGV[3]  session id
--
-- KEYS count: 10; 11 with the order index
-- Mode: mutating
-- Reply: status=ok|deleted=<0|1>
-- The outcome stays in the outcome hashes and the last epoch in a tombstone (neither holds
-- any of the session's content), so that a retry gets deleted=1 back and a session opened
-- again under the same id starts at a later epoch: handles and jobs of the deleted one stay
-- fenced. Both live the op retention, the tombstone longer when the epoch is ahead of
-- Redis's clock (hard resets add one each): until that clock has passed the last epoch by
-- the op retention, so that no later incarnation, which starts at that clock, can begin
-- below an epoch a handle of this one holds.
-- Errors: LEDGER_BADARG, LEDGER_STALE, LEDGER_OPREUSED.
-- Calls: HGET, HMGET, HGETALL (only with open reservations), ZREM, DEL, TIME, HSET, PEXPIRE.

local op, fp, epoch = op_args('delete', true)
local sid
sid = session_arg(ARGV[3])
if #ARGV ~= 3 then fail('BADARG', 'expected 3 arguments, got ' .. #ARGV) end
local data = { 'deadlines', 'content:%s', 'compacted:%s', 'history:%s', 'spill:%s', 'spilled:%s' }
if #KEYS == 11 then data[#data + 1] = 'order:%s' end
key_arg(2, unpack(data))
local dead = { KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], #KEYS == 11 and KEYS[8] or nil }
local key = KEYS[1]
local H, R = load(key, { 'ep', 'nv', 'ort', 'lo' }, 3)
local again = replay(recorded(op), op, fp)
if again then return again end
if not H.ep then  -- (what an expired session left is deleted all the same)
  redis.call('DEL', unpack(dead))
  return reply({ 'status=ok', 'deleted=0' })
end
stale(H.ep, epoch)
local members = {}
if R[1] then members[1] = sid .. '|' .. LEASE end
if H.nv > 0 then
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local rid = string.match(all[i], '^r:(.+)$')
    if rid then members[#members + 1] = sid .. '|' .. rid end
  end
end
call_each('ZREM', KEYS[2], members)
redis.call('DEL', key, unpack(dead))
local out = reply({ 'status=ok', 'deleted=1' })
local keep = math.max(H.ort, H.ep - now_ms() + H.ort)
redis.call('HSET', key, 'pe', H.ep)
redis.call('PEXPIRE', key, keep)
store(fp, out, false)
redis.call('PEXPIRE', OUT, H.ort)
return out
