-- admit_lean.lua: the least a checked, at-most-once single-item admit does, as a
-- benchmark reference (bench_scale's admit phase). Not a ledger operation: one item,
-- no floors beyond one consumer's, no compaction credit, no refusal reasons, no
-- outcome rotation or TTL refresh, no error wrapper, no shared helpers.
--
-- What it keeps is what the ledger promises on every call: every argument checked
-- before the first write, the call's fingerprint computed by the server, the outcome
-- looked up (current generation) and stored under the op id, the epoch fenced, the
-- window's free tokens kept exact. Its server time beside admit_plain.lua is the cost
-- of those promises with this data layout; ledger/lua/admit.lua adds the rest of the rules.
--
-- KEYS[1] session hash, KEYS[2] outcome hash (KEYS[3], the previous one, is not read)
-- ARGV    the ARGV of a real single-item admit call (ledger/lua/admit.lua)
-- Reply   admit's reply on success; 'refused' or 'replay' otherwise

local A, key, out = ARGV, KEYS[1], KEYS[2]
local op, c, id = A[1], A[3], A[6]
local g = ({ w = 'w', r = 'rm', m = 'rm', s = 's' })[c]
local epoch, t, pr = tonumber(A[2]), tonumber(A[7]), tonumber(A[8])
local idc = '^[%w%._:/@%+=#%-]+$'
if #KEYS ~= 3 or #A ~= 8 or A[5] ~= '1' or not g or (A[4] ~= 'all' and A[4] ~= 'prefix')
  or #op > 128 or not string.find(op, idc) or #id > 128 or not string.find(id, idc)
  or not string.find(A[2], '^%d+$') or not string.find(A[7], '^%d+$') or t < 1 or t > 1e8
  or not string.find(A[8], '^%d+$') or pr > 1000 then
  return redis.error_reply('BADARG')
end
local fp = string.sub(redis.sha1hex('admit\31' .. table.concat(A, '\31', 2)), 1, 12)
local f = 'i:' .. c .. ':' .. id
local v = redis.call('HMGET', key, 'ep', 'tn', 'sq', 'fr', 'a_' .. g, 'F_' .. g, 'u_' .. c,
  'n_' .. c, f)
local h = redis.sha1hex(op)
local b, at = string.sub(h, 1, 2), '\30' .. string.sub(h, 3, 16)
local src = redis.call('HGET', out, b) or ''
if string.find(src, at, 1, true) then return 'replay' end
if tonumber(v[1]) ~= epoch then return redis.error_reply('STALE') end
if v[9] then return 'duplicate' end
local a, floor, sq, fr = tonumber(v[5]), tonumber(v[6]) or 0, tonumber(v[3]), tonumber(v[4])
local d = math.max(a + t, floor) - math.max(a, floor)
if d > fr then return 'refused' end
fr, sq = fr - d, sq + 1
redis.call('HSET', out, b, src .. at .. fp ..
  string.format('\1ok\7%d\81\90\10\4%d\5%s\6%s', t, fr, v[1], v[2]))
redis.call('HSET', key, f, string.format('%d|%s|%d|%d', t, v[2], pr, sq), 'sq', sq, 'fr', fr,
  'a_' .. g, a + t, 'u_' .. c, tonumber(v[7]) + t, 'n_' .. c, tonumber(v[8]) + 1)
return string.format('status=ok|charged=%d|admitted=1|duplicates=0|skipped=|free=%d|epoch=%s|turn=%s',
  t, fr, v[1], v[2])
