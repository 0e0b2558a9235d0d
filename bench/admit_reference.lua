-- admit_reference.lua: a careful single-item admit written by hand, the reference
-- bench_turn compares ledger/lua/admit.lua with. Not a ledger operation. It keeps the promises
-- every ledger call makes: every argument checked before the first write, at-most-once
-- through an op key (SET PX holding the reply, so a retry gets the first reply back),
-- the epoch fenced, a refusal when the item does not fit (nothing written). It has none
-- of the ledger's rules beyond one consumer's floor, and one key per outcome.
--
-- KEYS[1] session hash (a ledger session's), KEYS[2] the op key (same hash slot)
-- ARGV    op id, epoch, consumer, item id, tokens, priority, retention ms

local A = ARGV
local idc = '^[%w%._:/@%+=#%-]+$'
local g = ({ w = 'w', r = 'rm', m = 'rm', s = 's' })[A[3]]
if #KEYS ~= 2 or #A ~= 7 or not g or #A[1] > 128 or not string.find(A[1], idc)
  or #A[4] > 128 or not string.find(A[4], idc) or not string.find(A[2], '^%d+$')
  or not string.find(A[5], '^[1-9]%d*$') or tonumber(A[5]) > 1e8
  or not string.find(A[6], '^%d+$') or tonumber(A[6]) > 1000
  or not string.find(A[7], '^[1-9]%d*$') then
  return redis.error_reply('BADARG')
end
local fp = redis.sha1hex(table.concat(A, '\31', 2))
local done = redis.call('GET', KEYS[2])
if done then
  if string.sub(done, 1, 40) ~= fp then return redis.error_reply('OPREUSED') end
  return string.sub(done, 41)
end
local c, t = A[3], tonumber(A[5])
local f = 'i:' .. c .. ':' .. A[4]
local v = redis.call('HMGET', KEYS[1], 'ep', 'tn', 'sq', 'fr', 'a_' .. g, 'F_' .. g, 'u_' .. c,
  'n_' .. c, f)
if not v[1] then return redis.error_reply('NOSESSION') end
if v[1] ~= A[2] then return redis.error_reply('STALE') end
local out
if v[9] then
  out = 'status=ok|charged=0|duplicates=1'
else
  local a, floor, fr = tonumber(v[5]), tonumber(v[6]) or 0, tonumber(v[4])
  local d = math.max(a + t, floor) - math.max(a, floor)
  if d > fr then
    out = 'status=refused|reason=token_budget_exhausted|free=' .. fr
  else
    local sq = tonumber(v[3]) + 1
    fr = fr - d
    redis.call('HSET', KEYS[1], f, string.format('%d|%s|%s|%d', t, v[2], A[6], sq), 'sq', sq,
      'fr', fr, 'a_' .. g, a + t, 'u_' .. c, tonumber(v[7]) + t, 'n_' .. c, tonumber(v[8]) + 1)
    out = string.format('status=ok|charged=%d|free=%d|epoch=%s|turn=%s', t, fr, v[1], v[2])
  end
end
redis.call('SET', KEYS[2], fp .. out, 'PX', A[7])
return out
