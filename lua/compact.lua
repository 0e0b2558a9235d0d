-- compact.lua: commit a compaction of the session's history and judge it
-- (the compaction-credit rule, docs/rules.md#compaction-credit).
--
-- The compactor replaced some items (old working-memory turns, and stale retrieval
-- chunks or tool results, which are history too) by one working-memory summary. The post-
-- condition occupancy <= high-water mark is hard: a compaction that misses it is
-- a failed compaction (a deferral). Its effect is still applied (the tokens are
-- real), the compaction stays pending, and after the configured number of
-- consecutive failures a hard-reset job is appended to the partition's job stream
-- in this same step, so no crash can lose the escalation.
--
-- KEYS[1]  session hash
-- KEYS[2]  partition job stream
-- KEYS[3]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[4]  previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch                   integer; older than the session's -> LEDGER_STALE
-- ARGV[3]  session id              must name KEYS[1]
-- ARGV[4]  summary item id         the working-memory item that replaces them
-- ARGV[5]  summary tokens          0..1e8 (0: nothing replaces them)
-- ARGV[6]  n                       number of items replaced, 0..1000
-- ARGV[7..6+n]                     '<c>:<item id>' with c in w r m s (items not held are
--                                  reported as missing)
-- ARGV[7+n] job entry id           the id ('<ms>-<seq>') of the job's entry in KEYS[2] when
--                                  a worker commits a compaction job, '-' otherwise (an
--                                  agent's own compaction). The entry is deleted in the same
--                                  step as the effect, so a job's effect happens once for
--                                  its whole life in the stream, whatever the op retention.
--
-- Reply: status=ok|outcome=<compacted|failed|deferred|did_not_fit|already>|occupancy=<tokens>
--          |high_water=<tokens>|dropped=<tokens>|summary=<tokens>|missing=<id,...>|failures=<n>
--          |escalated=<0|1>|free=<tokens>|epoch=<n>|turn=<n>|gain=<tokens>
--   outcome did_not_fit: the summary does not fit once the items are gone; nothing is
--   replaced, and it counts as a failed compaction. deferred: occupancy is at or under
--   the mark but the compaction freed (gain: occupancy before minus after) less than the
--   session's compaction min gain (kg); applied, and counted as a failed compaction.
--   outcome already: the job entry named by ARGV[8+n] is no longer in the stream (its
--   compaction was committed before, or the entry was lost with its stream): nothing is
--   changed or stored; dropped=0, summary=0, escalated=0, the other fields as they are.
--   Once a hard reset is requested (escalated before, not yet reset), a failed
--   compaction is not counted again: failures and x:failed_compactions stay at the
--   escalation's count until the reset.
-- Stream entries: on escalation kind=hard_reset session=<id> epoch=<n> reason=failed_compactions
--   op=<op id>; on a failure that does not escalate, kind=compact (the compaction is retried:
--   a new compaction request, a new attempt), for worker-owned sessions only.
-- Errors: LEDGER_BADARG, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED,
--         LEDGER_CONFLICT (the summary id is held and not among the replaced items).
-- Calls: HMGET, XDEL (a job), TIME, HDEL, HSET, HGET and XADD (on escalation or retry), HINCRBY.

local op, fp, epoch = op_args('compact', false)
local sid, sum_id, sum_t, n
sid = session_arg(ARGV[3])
sum_id = id_arg(ARGV[4], 'summary item id')
sum_t = int_arg(ARGV[5], 'summary tokens', 0, TOKENS_MAX)
n = int_arg(ARGV[6], 'item count', 0, 1000)
if #ARGV ~= 7 + n then
  fail('BADARG', 'expected ' .. (7 + n) .. ' arguments for ' .. n .. ' items, got ' .. #ARGV)
end
-- A stream entry id: two unsigned 64-bit decimals (an id XDEL would refuse is a BADARG).
local job = ARGV[7 + n]
local function u64(d) return d and (#d < 20 or (#d == 20 and d <= '18446744073709551615')) end
if job ~= '-' then
  local ms, seq = string.match(type(job) == 'string' and job or '', '^(%d+)%-(%d+)$')
  if not (u64(ms) and u64(seq)) then
    fail('BADARG', 'job entry id must be <ms>-<seq> or -, got ' .. show(job))
  end
end
local NUM = { 'ep', 'tn', 'sq', 'W', 'S', 'T', 'out', 'F_w', 'F_m', 'a_w', 'a_m', 'a_s', 'u_w', 'u_r', 'u_m',
  'u_s', 'n_w', 'n_r', 'n_m', 'n_s', 'HW', 'kf', 'kn', 'cx', 'rq', 'gz', 'xp', 'kg', 'cd' }
local fields = { 'i:w:' .. sum_id }
for i = #NUM, 1, -1 do table.insert(fields, 1, NUM[i]) end
local seen, refs = {}, {}
for k = 1, n do
  local ref = ARGV[6 + k]
  local c, id = string.match(type(ref) == 'string' and ref or '', '^([wrms]):(.+)$')
  if not c then fail('BADARG', 'replaced item must be <c>:<id> with c in wrms, got ' .. show(ref)) end
  id = id_arg(id, 'item id')
  if seen[ref] then fail('BADARG', 'item ' .. id .. ' of ' .. consumer_name(c) .. ' appears twice') end
  seen[ref] = true
  refs[k] = { c = c, id = id }
  fields[#fields + 1] = 'i:' .. ref
end

key_arg(2, 'jobs')
local key = KEYS[1]
local H, R = load(key, fields, #NUM)
local again = gate(recorded(op), H.ep, op, fp, epoch)
if again then return again end
if R[1] and not seen['w:' .. sum_id] then
  fail('CONFLICT', 'working memory already holds ' .. sum_id .. ' and it is not being replaced')
end
-- Every check is done. A job's entry is deleted here, with the effect: when XDEL deletes
-- nothing (the entry is gone) nothing has been written and the call replies 'already'.
if job ~= '-' and redis.call('XDEL', KEYS[2], job) == 0 then
  return reply({ 'status=ok', 'outcome=already', 'occupancy=' .. (H.S + H.T + H.a_w + H.a_m + H.a_s),
    'high_water=' .. H.HW, 'dropped=0', 'summary=0', 'missing=', 'failures=' .. H.kf, 'escalated=0',
    'free=' .. (H.W - H.S - H.T - H.out - math.max(H.a_w, H.F_w) - math.max(H.a_m, H.F_m) - H.a_s),
    'epoch=' .. H.ep, 'turn=' .. H.tn })
end
local now = now_ms()
local J = { gz = H.gz, xp = H.xp }
local A = { w = H.a_w, m = H.a_m, s = H.a_s }
local U = { w = H.u_w, r = H.u_r, m = H.u_m, s = H.u_s }
local N = { w = H.n_w, r = H.n_r, m = H.n_m, s = H.n_s }
local dropped, dead, missing = 0, {}, {}
for k = 1, n do
  local rec, c = R[1 + k], refs[k].c
  if rec then
    local t = tonumber(string.match(rec, '^(%d+)|'))
    dropped = dropped + t
    A[GROUP[c]], U[c], N[c] = A[GROUP[c]] - t, U[c] - t, N[c] - 1
    dead[#dead + 1] = fields[#NUM + 1 + k]
  else
    missing[#missing + 1] = ARGV[6 + k]
  end
end
A.w = A.w + sum_t
local fr = H.W - H.S - H.T - H.out - math.max(A.w, H.F_w) - math.max(A.m, H.F_m) - A.s
-- A summary that does not fit cannot be applied (that would over-allocate): it is a
-- failed compaction with no effect, judged like one that misses the mark.
local fits = fr >= 0
if not fits then
  A = { w = H.a_w, m = H.a_m, s = H.a_s }
  U = { w = H.u_w, r = H.u_r, m = H.u_m, s = H.u_s }
  N = { w = H.n_w, r = H.n_r, m = H.n_m, s = H.n_s }
  fr = H.W - H.S - H.T - H.out - math.max(A.w, H.F_w) - math.max(A.m, H.F_m) - A.s
  dead, dropped, sum_t = {}, 0, 0
end
local occ = H.S + H.T + A.w + A.m + A.s
local gain = H.S + H.T + H.a_w + H.a_m + H.a_s - occ
local deferred = fits and occ <= H.HW and gain < (H.kg or 0)  -- bought too little: a deferral
local ok = fits and occ <= H.HW and not deferred
-- no failure counts past an escalation, until the reset
local kf = ok and 0 or (H.rq == 0 and H.kf + 1 or H.kf)
local escalate = (not ok) and kf >= H.cx and H.rq == 0
if #dead > 0 then redis.call('HDEL', key, unpack(dead)) end
local sq, args = H.sq, {}
if sum_t > 0 then
  sq = sq + 1
  args = { 'i:w:' .. sum_id, table.concat({ sum_t, H.tn, 1000, sq }, '|') }
  U.w, N.w = U.w + sum_t, N.w + 1
end
local upd = { 'sq', sq, 'a_w', A.w, 'a_m', A.m, 'a_s', A.s, 'fr', fr, 'kf', kf, 'cd', ok and 0 or 1 }
for _, c in ipairs({ 'w', 'r', 'm', 's' }) do
  upd[#upd + 1], upd[#upd + 2], upd[#upd + 3], upd[#upd + 4] = 'u_' .. c, U[c], 'n_' .. c, N[c]
end
for i = 1, #upd do args[#args + 1] = upd[i] end
if ok then
  args[#args + 1], args[#args + 2], args[#args + 3], args[#args + 4] = 'kn', H.kn + 1, 'kt', H.tn
elseif H.rq == 0 then
  redis.call('HINCRBY', key, 'x:failed_compactions', 1)
end
if escalate then
  enqueue(KEYS[2], 'hard_reset', sid, H.ep, op, 'failed_compactions')
  redis.call('HINCRBY', key, 'x:escalations', 1)
  args[#args + 1], args[#args + 2] = 'rq', 1
elseif not ok and H.rq == 0 and worker_compacts(key) and (job ~= '-' or H.cd ~= 1) then
  -- (an agent's own failed compaction while a job is queued already adds no second one)
  enqueue(KEYS[2], 'compact', sid, H.ep, op, 'failed_compaction')
end
return commit(key, now, op, fp, table.concat({ 'status=ok|outcome=',
  ok and 'compacted' or (deferred and 'deferred' or (fits and 'failed' or 'did_not_fit')),
  '|occupancy=', occ, '|high_water=', H.HW, '|dropped=', dropped, '|summary=', sum_t, '|missing=',
  table.concat(missing, ','), '|failures=', kf, '|escalated=', escalate and 1 or 0, '|free=', fr,
  '|epoch=', H.ep, '|turn=', H.tn, '|gain=', gain }), args, J)
