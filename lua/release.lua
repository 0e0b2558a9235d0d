-- release.lua: give back items a consumer holds.
--
-- KEYS[1]  session hash
-- KEYS[2]  (optional) reclaim-order index  '<tag>:order:<session>': the items released
--          leave it when sent (see ORDER in _common.lua)
-- KEYS[-3] partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[-2] outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[-1] previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch[@turn]             integer; older than the session's -> LEDGER_STALE; @turn:
--                                  a call of that turn (see `fence`)
-- ARGV[3]  consumer                w | r | m | s
-- ARGV[4]  n                       number of item ids, 1..1000
-- ARGV[5..4+n]  item ids
--
-- KEYS count: 4; 5 with the order index
-- Mode: mutating
-- Reply: status=ok|released=<tokens>|count=<n>|missing=<id,...>|free=<tokens>|epoch=<n>|turn=<n>
-- Ids the consumer does not hold are listed as missing; they are not an error.
-- Errors: LEDGER_BADARG, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED, LEDGER_TURNHELD,
--         LEDGER_TURNLOST (see `fence` in _common.lua).
-- Calls: HMGET, TIME, HSET, HDEL (ZREM and EXISTS of the reclaim-order index when sent; HMGET of the op's outcome bucket and the epoch base e, HSET of the bucket; a PEXPIRE, or the outcome generations' RENAME and PEXPIRE, when due).

local op, fp, epoch, tok = op_args('release', false)
local c
c = consumer_arg(ARGV[3])
local n
n = int_arg(ARGV[4], 'item count', 1, 1000)
if #ARGV ~= 4 + n then
  fail('BADARG', 'expected ' .. (4 + n) .. ' arguments for ' .. n .. ' item ids, got ' .. #ARGV)
end
local ORD = #KEYS == 5 and KEYS[2] or nil
if ORD then key_arg(2, 'order:%s') end
local A, F = ACTIVE[c], FLOOR[c]
local raws, seen = { 'ep', 'tn', 'fr', A, F, 'u_' .. c, 'n_' .. c, 'gz', 'xp', 'lo', 'ul', 'uo' }, {}
for k = 1, n do
  local id
  id = id_arg(ARGV[4 + k], 'item id')
  if seen[id] then fail('BADARG', 'item id ' .. id .. ' appears twice') end
  seen[id] = true
  raws[k + 12] = 'i:' .. c .. ':' .. id
end

local key = KEYS[1]
local H, R = load(key, raws, 9)
local again = gate(recorded(op), H.ep, op, fp, epoch)
if again then return again end
local in_turn = fence(key, R[1], H.tn, tok)
local now = now_ms()

local tokens, count, missing, dead, was = 0, 0, {}, {}, {}
for k = 1, n do
  local rec = R[k + 3]
  if rec then
    tokens = tokens + tonumber(string.match(rec, '^(%d+)|'))
    count = count + 1
    dead[#dead + 1] = raws[k + 12]
    was[#dead] = rec
  else
    missing[#missing + 1] = ARGV[4 + k]
  end
end
local a = H[A]
local fr = H.fr - claim_delta(a, -tokens, H[F] or 0)
local args = {}
if count > 0 then
  redis.call('HDEL', key, unpack(dead))
  args = { 'fr', fr, A, a - tokens, 'u_' .. c, H['u_' .. c] - tokens, 'n_' .. c, H['n_' .. c] - count }
  if ORD and ORDER[c] and order_remove(ORD, dead) then args[#args + 1], args[#args + 2] = 'ox', 0 end
  if in_turn then args[#args + 1], args[#args + 2] = 'ul', journal(R[2], dead, was) end
end
return commit(key, now, op, fp, reply({ 'status=ok', 'released=' .. tokens, 'count=' .. count,
  'missing=' .. table.concat(missing, ','), 'free=' .. fr, 'epoch=' .. H.ep, 'turn=' .. H.tn }),
  args, { gz = H.gz, xp = H.xp, uo = in_turn and (R[3] or '') or nil })
