-- compact.lua: commit a working-memory compaction and judge it (record 001).
--
-- The compactor replaced some working-memory items by a summary. The post-
-- condition occupancy <= high-water mark is hard: a compaction that misses it is
-- a failed compaction (a deferral). Its effect is still applied (the tokens are
-- real), the compaction stays pending, and after the configured number of
-- consecutive failures a hard-reset job is appended to the partition's job stream
-- in this same step, so no crash can lose the escalation.
--
-- KEYS[1]  session hash
-- KEYS[2]  partition job stream
-- ARGV[1]  operation id            ARGV[2] argument fingerprint (hex)
-- ARGV[3]  epoch                   integer; older than the session's -> LEDGER_STALE
-- ARGV[4]  session id              must name KEYS[1]
-- ARGV[5]  summary item id         the working-memory item that replaces them
-- ARGV[6]  summary tokens          0..1e8 (0: nothing replaces them)
-- ARGV[7]  n                       number of working-memory item ids replaced, 0..1000
-- ARGV[8..7+n]                     their ids (ids not held are reported as missing)
--
-- Reply: status=ok|outcome=<compacted|failed>|occupancy=<tokens>|high_water=<tokens>
--          |dropped=<tokens>|summary=<tokens>|missing=<id,...>|failures=<n>|escalated=<0|1>
--          |free=<tokens>|epoch=<n>|turn=<n>
--    or  status=refused|reason=token_budget_exhausted|requested=<summary tokens>|free=<tokens>
--          |epoch=<n>|turn=<n>   (the summary does not fit; nothing changes)
-- Stream entries: on escalation kind=hard_reset session=<id> epoch=<n> reason=failed_compactions
--   op=<op id>; on a failure that does not escalate, kind=compact (the compaction is retried).
-- Errors: LEDGER_BADARG, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED,
--         LEDGER_CONFLICT (the summary id is held and not among the replaced items).
-- Calls: HMGET, TIME, HDEL, HSET, XADD (on escalation), HINCRBY.

local op, fp, epoch, e = op_args(false)
if e then return e end
local sid, sum_id, sum_t, n
sid, e = session_arg(ARGV[4])
if e then return e end
sum_id, e = id_arg(ARGV[5], 'summary item id')
if e then return e end
sum_t, e = int_arg(ARGV[6], 'summary tokens', 0, TOKENS_MAX)
if e then return e end
n, e = int_arg(ARGV[7], 'item count', 0, 1000)
if e then return e end
if #ARGV ~= 7 + n then
  return err('BADARG', 'expected ' .. (7 + n) .. ' arguments for ' .. n .. ' item ids, got ' .. #ARGV)
end
local fields = { 'ep', 'tn', 'sq', 'W', 'S', 'T', 'out', 'F_w', 'F_m', 'a_w', 'a_m', 'a_s', 'u_w', 'n_w',
  'HW', 'kf', 'kn', 'cx', 'rq', 'gz', 'xp', 'o:' .. op, 'ol', 'i:w:' .. sum_id }
local seen = {}
for k = 1, n do
  local id
  id, e = id_arg(ARGV[7 + k], 'item id')
  if e then return e end
  if seen[id] then return err('BADARG', 'item id ' .. id .. ' appears twice') end
  seen[id] = true
  fields[#fields + 1] = 'i:w:' .. id
end

local key = KEYS[1]
local H, R = load(key, fields, 21)
e = gate(H, R, op, fp, epoch)
if e then return e end
if R[3] and not seen[sum_id] then
  return err('CONFLICT', 'working memory already holds ' .. sum_id .. ' and it is not being replaced')
end
local now = now_ms()
local J = { ol = R[2], gz = H.gz, xp = H.xp }
local dropped, count, dead, missing = 0, 0, {}, {}
for k = 1, n do
  local rec = R[3 + k]
  if rec then
    dropped = dropped + tonumber(string.match(rec, '^(%d+)|'))
    count = count + 1
    dead[#dead + 1] = fields[21 + 3 + k]
  else
    missing[#missing + 1] = ARGV[7 + k]
  end
end
local a_w = H.a_w - dropped + sum_t
local fr = H.W - H.S - H.T - H.out - math.max(a_w, H.F_w) - math.max(H.a_m, H.F_m) - H.a_s
if fr < 0 then
  redis.call('HINCRBY', key, 'x:refused', 1)
  local fr0 = H.W - H.S - H.T - H.out - math.max(H.a_w, H.F_w) - math.max(H.a_m, H.F_m) - H.a_s
  return commit(key, now, op, fp, table.concat({ 'status=refused|reason=token_budget_exhausted|requested=',
    sum_t, '|free=', fr0, '|epoch=', H.ep, '|turn=', H.tn }), {}, J)
end
local occ = H.S + H.T + a_w + H.a_m + H.a_s
local ok = occ <= H.HW
local kf = ok and 0 or H.kf + 1
local escalate = (not ok) and kf >= H.cx and H.rq == 0
if #dead > 0 then redis.call('HDEL', key, unpack(dead)) end
local u_w, n_w, sq = H.u_w - dropped, H.n_w - count, H.sq
local args = {}
if sum_t > 0 then
  sq = sq + 1
  args = { 'i:w:' .. sum_id, table.concat({ sum_t, H.tn, 1000, sq }, '|') }
  u_w, n_w = u_w + sum_t, n_w + 1
end
local upd = { 'sq', sq, 'a_w', a_w, 'u_w', u_w, 'n_w', n_w, 'fr', fr, 'kf', kf, 'cd', ok and 0 or 1 }
for i = 1, #upd do args[#args + 1] = upd[i] end
if ok then
  args[#args + 1], args[#args + 2], args[#args + 3], args[#args + 4] = 'kn', H.kn + 1, 'kt', H.tn
else
  redis.call('HINCRBY', key, 'x:failed_compactions', 1)
end
if escalate then
  enqueue(KEYS[2], 'hard_reset', sid, H.ep, op, 'failed_compactions')
  redis.call('HINCRBY', key, 'x:escalations', 1)
  args[#args + 1], args[#args + 2] = 'rq', 1
elseif not ok and H.rq == 0 then
  enqueue(KEYS[2], 'compact', sid, H.ep, op, 'failed_compaction')
end
return commit(key, now, op, fp, table.concat({ 'status=ok|outcome=', ok and 'compacted' or 'failed',
  '|occupancy=', occ, '|high_water=', H.HW, '|dropped=', dropped, '|summary=', sum_t, '|missing=',
  table.concat(missing, ','), '|failures=', kf, '|escalated=', escalate and 1 or 0, '|free=', fr,
  '|epoch=', H.ep, '|turn=', H.tn }), args, J)
