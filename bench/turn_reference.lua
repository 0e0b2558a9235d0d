-- turn_reference.lua: a careful two-call governed turn written by hand, the reference a
-- ledger turn is compared with. Not a ledger operation. Each call keeps the promises
-- every ledger call makes: every key and argument checked before the first write (the
-- texts are any bytes, as the ledger takes them); at most once through an op key (SET PX
-- holding the fingerprint and the reply, so a retry gets the first reply back and an op id
-- used with other arguments is refused); the epoch fenced; the turn's lease (an owner
-- token and a deadline) fenced; a refusal changes nothing but its op key (its outcome,
-- kept like any other). It has none of the ledger's rules beyond the free room, and one
-- key per outcome. Nor does it do what the ledger's begin_turn does for a turn already
-- open: the same owner beginning again simply opens the next turn (the ledger ends the
-- open one first), and another owner's lapsed lease is taken over without a rollback.
--
-- With a mode ending in '!' ('start!', 'finish!') it sends the same Redis commands with the
-- same values but checks nothing and fingerprints nothing: the commands' own cost. With a
-- mode ending in '~' it leaves the texts out of the fingerprint, as a design would whose
-- client sends their digest instead (not sent here: 40 bytes more would change nothing).
--
-- KEYS[1] session hash, KEYS[2] content store, KEYS[3] reclaim-order index, KEYS[4] the
-- partition's deadline index (the lease's member), KEYS[5] op key (all one hash slot)
-- start:  ARGV = 'start', op id, epoch, owner token, lease ms, retention ms, n,
--                n quads (consumer, item id, tokens, priority), n texts
--         -> begins the turn (refused while another owner's lease runs) and admits the
--            n items whole or none (their texts stored, retrieval in the order index)
-- finish: ARGV = 'finish', op id, epoch, owner token, turn, retention ms, prompt tokens,
--                tool item id, tokens, priority, text
--         -> admits the tool result whole into the scratchpad and ends the turn: drift
--            against the prompt, compaction due over the high-water mark, the lease goes

local A, K = ARGV, KEYS
local form = string.match(A[1], '[!~]$')
local bare, mode = form == '!', form and string.sub(A[1], 1, -2) or A[1]
local idc = '^[%w%._:/@%+=#%-]+$'
local G = { w = 'a_w', r = 'a_rm', m = 'a_rm', s = 'a_s' }
local function bad(what) return redis.error_reply('BADARG ' .. what) end
local function id_ok(v) return bare or #v <= 128 and string.find(v, idc) end
local function int_ok(v, lo, hi)
  if bare then return true end
  if v ~= '0' and not string.find(v, '^[1-9]%d*$') then return false end  -- (canonical)
  local n = tonumber(v)
  return n >= lo and n <= hi
end
local tag, sid = string.match(K[1] or '', '^([^{]*{p%d+}):s:(.+)$')
if #K ~= 5 or not tag then return bad('keys') end
local op_key = tag .. ':op:' .. sid .. ':'
if not bare and (K[2] ~= tag .. ':content:' .. sid or K[3] ~= tag .. ':order:' .. sid or
    K[4] ~= tag .. ':deadlines' or string.sub(K[5], 1, #op_key) ~= op_key) then
  return bad('keys')
end
if not id_ok(A[2]) then return bad('op id') end
if not int_ok(A[3], 0, 1e15) then return bad('epoch') end
if not bare and (#A[4] < 16 or #A[4] > 64 or not string.find(A[4], '^%x+$')) then
  return bad('owner token')
end

local signed = #A  -- (the arguments the fingerprint covers)
if form == '~' then signed = mode == 'start' and 7 + 4 * (tonumber(A[7]) or 0) or 10 end
local fp = bare and string.rep('0', 40) or
  redis.sha1hex(table.concat(A, '\31', 1, math.min(signed, #A)))
local done = redis.call('GET', K[5])
if done then
  if string.sub(done, 1, 40) ~= fp then return redis.error_reply('OPREUSED') end
  return string.sub(done, 41)
end

if mode == 'start' then
  if not int_ok(A[5], 1, 1e9) or not int_ok(A[6], 1, 1e12) then return bad('lease or retention') end
  if not int_ok(A[7], 1, 1000) then return bad('item count') end
  local n = tonumber(A[7])
  if #A ~= 7 + 5 * n then return bad('argument count') end
  local fields, seen = { 'ep', 'tn', 'lo', 'le', 'sq', 'fr', 'a_w', 'a_rm', 'a_s' }, {}
  for k = 1, n do
    local b = 4 + 4 * k
    local c, id = A[b], A[b + 1]
    if not bare and not G[c] then return bad('consumer') end
    if not id_ok(id) then return bad('item id') end
    local f = 'i:' .. c .. ':' .. id
    if seen[f] and not bare then return bad('item twice') end
    seen[f] = true
    if not int_ok(A[b + 2], 1, 1e8) or not int_ok(A[b + 3], 0, 1000) then
      return bad('tokens or priority')
    end
    fields[9 + k] = f
  end
  local v = redis.call('HMGET', K[1], unpack(fields))
  if not v[1] then return redis.error_reply('NOSESSION') end
  if v[1] ~= A[3] then return redis.error_reply('STALE') end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if v[3] and v[3] ~= A[4] and tonumber(v[4]) > now then return redis.error_reply('TURNHELD') end
  local tn, sq, fr = tonumber(v[2]) + 1, tonumber(v[5]), tonumber(v[6])
  local occ = { a_w = tonumber(v[7]), a_rm = tonumber(v[8]), a_s = tonumber(v[9]) }
  local f, set, texts, z, charged = string.format, {}, {}, {}, 0
  for k = 1, n do
    local b = 4 + 4 * k
    if not v[9 + k] then
      local d = tonumber(A[b + 2])
      charged, sq = charged + d, sq + 1
      occ[G[A[b]]] = occ[G[A[b]]] + d
      set[#set + 1], set[#set + 2] = fields[9 + k], f('%s|%d|%s|%d', A[b + 2], tn, A[b + 3], sq)
      texts[#texts + 1], texts[#texts + 2] = string.sub(fields[9 + k], 3), A[7 + 4 * n + k]
      if A[b] == 'r' or A[b] == 'm' then z[#z + 1], z[#z + 2] = sq, fields[9 + k] end
    end
  end
  local out
  if charged > fr then
    out = f('status=refused|reason=token_budget_exhausted|requested=%d|free=%d', charged, fr)
  else
    fr = fr - charged
    local tns, frs = f('%d', tn), f('%d', fr)
    set[#set + 1], set[#set + 2], set[#set + 3], set[#set + 4] = 'tn', tns, 'lo', A[4]
    set[#set + 1], set[#set + 2] = 'le', f('%d', now + tonumber(A[5]))
    set[#set + 1], set[#set + 2] = 'sq', f('%d', sq)
    set[#set + 1], set[#set + 2] = 'fr', frs
    for g, a in pairs(occ) do set[#set + 1], set[#set + 2] = g, f('%d', a) end
    redis.call('HSET', K[1], unpack(set))
    redis.call('ZADD', K[4], now + tonumber(A[5]), sid .. '|~')
    if #texts > 0 then redis.call('HSET', K[2], unpack(texts)) end
    if #z > 0 then redis.call('ZADD', K[3], unpack(z)) end
    out = f('status=ok|turn=%s|charged=%d|free=%s|epoch=%s', tns, charged, frs, v[1])
  end
  redis.call('SET', K[5], fp .. out, 'PX', A[6])
  return out
end

if mode ~= 'finish' then return bad('mode') end
if #A ~= 11 then return bad('argument count') end
if not int_ok(A[5], 1, 1e15) or not int_ok(A[6], 1, 1e12) or not int_ok(A[7], 1, 1e9) then
  return bad('turn, retention or prompt tokens')
end
if not id_ok(A[8]) or not int_ok(A[9], 1, 1e8) or not int_ok(A[10], 0, 1000) then
  return bad('tool item')
end
local f = 'i:s:' .. A[8]
local v = redis.call('HMGET', K[1], 'ep', 'tn', 'lo', 'le', 'sq', 'fr', 'a_w', 'a_rm', 'a_s',
  'S', 'T', 'HW', f)
if not v[1] then return redis.error_reply('NOSESSION') end
if v[1] ~= A[3] then return redis.error_reply('STALE') end
if v[2] ~= A[5] or v[3] ~= A[4] then return redis.error_reply('TURNLOST') end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(v[4]) < now then return redis.error_reply('TURNLOST lease') end
local fmt = string.format
local fr, a_s, sq, d = tonumber(v[6]), tonumber(v[9]), tonumber(v[5]), 0
local set = {}
if not v[13] then
  d = tonumber(A[9])
  if d > fr then
    local out = fmt('status=refused|reason=token_budget_exhausted|requested=%d|free=%d', d, fr)
    redis.call('SET', K[5], fp .. out, 'PX', A[6])
    return out
  end
  fr, a_s, sq = fr - d, a_s + d, sq + 1
  set = { f, fmt('%s|%s|%s|%d', A[9], v[2], A[10], sq), 'sq', fmt('%d', sq) }
end
local occ = tonumber(v[10]) + tonumber(v[11]) + tonumber(v[7]) + tonumber(v[8]) + a_s
local final = tonumber(A[7])
local due = occ > tonumber(v[12]) and 1 or 0
for _, x in ipairs({ 'fr', fmt('%d', fr), 'a_s', fmt('%d', a_s), 'te', v[2], 'dp', A[7],
    'dr', fmt('%d', final - occ), 'cd', due }) do
  set[#set + 1] = x
end
redis.call('HSET', K[1], unpack(set))
if d > 0 then redis.call('HSET', K[2], 's:' .. A[8], A[11]) end
redis.call('HDEL', K[1], 'lo', 'le')
redis.call('ZREM', K[4], sid .. '|~')
local out = fmt('status=ok|turn=%s|charged=%d|occupancy=%d|drift=%d|compaction_due=%d|epoch=%s',
  v[2], d, occ, final - occ, due, v[1])
redis.call('SET', K[5], fp .. out, 'PX', A[6])
return out
