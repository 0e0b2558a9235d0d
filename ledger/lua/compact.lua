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
-- KEYS[3]  content store           '<tag>:content:<session>'
-- KEYS[4]  summaries               '<tag>:compacted:<session>'
-- KEYS[5]  partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[6]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[7]  previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch[@turn]             integer; older than the session's -> LEDGER_STALE; @turn:
--                                  a call of that turn (see `fence`)
-- ARGV[3]  session id              must name KEYS[1]
-- ARGV[4]  summary item id         the working-memory item that replaces them
-- ARGV[5]  summary tokens          0..1e8 (0: nothing replaces them)
-- ARGV[6]  n                       number of items replaced, 0..1000
-- ARGV[7..6+n]                     '<c>:<item id>' with c in w r m s, or '<c>:<item id>|<seq>':
--                                  only the version of the item admitted with that sequence
--                                  number (the one the compactor read) is replaced. Items not
--                                  held, or held in another version, are reported as missing
--                                  and stay.
-- ARGV[7+n] job entry id           the id ('<ms>-<seq>') of the job's entry in KEYS[2] when
--                                  a worker commits a compaction job, '-' otherwise (an
--                                  agent's own compaction). The entry is deleted in the same
--                                  step as the effect, so a job's effect happens once for
--                                  its whole life in the stream, whatever the op retention.
-- ARGV[8+n] summary text           the summary's text, or empty for none (part of the op
--                                  fingerprint)
--
-- When the effect is applied (every outcome but did_not_fit, already and turn_open), in the
-- same step: the texts of the replaced versions leave the content store and the records of
-- replaced summaries leave KEYS[4] (not for a compaction of the open turn, which a rollback
-- may undo); with a summary text and summary tokens > 0, KEYS[4] gets the summary's record,
-- JSON {"text":<text>,"replaced":["<c>:<id>",...],"at":<ms>} under its id (what the turn it
-- is delivered to reads), and the content store 'w:<summary id>' its text (what the next
-- compaction reads). An item held in another version keeps its text.
--
-- Reply: status=ok|outcome=<compacted|failed|deferred|did_not_fit|already|turn_open>
--          |occupancy=<tokens>|high_water=<tokens>|dropped=<tokens>|summary=<tokens>
--          |missing=<id,...>|failures=<n>|escalated=<0|1>|free=<tokens>|epoch=<n>|turn=<n>
--          |gain=<tokens>
--   outcome did_not_fit: the summary does not fit once the items are gone; nothing is
--   replaced, and it counts as a failed compaction. deferred: occupancy is at or under
--   the mark but the compaction freed (gain: occupancy before minus after) less than the
--   session's compaction min gain (kg); applied, and counted as a failed compaction.
--   outcome already: the job entry named by ARGV[7+n] is no longer in the stream (its
--   compaction was committed before, or the entry was lost with its stream): nothing is
--   changed or stored; dropped=0, summary=0, missing empty, escalated=0, the other fields
--   as they are, and no gain.
--   outcome turn_open: a job's compaction while a turn is open (its lease held, or lapsed
--   and not yet rolled back): nothing is changed or stored, the job's entry stays; the
--   worker commits once the turn has ended (a compaction never changes the prompt under
--   a running turn). The fields are those of already, then |owner=<the turn's owner>
--   |lease=<its end, ms> (no gain).
--   A compaction that is not part of the open turn (a worker's job, or one made with no turn
--   while none is open) queues its deliveries for the next turn (fields qs, qd): the
--   summary, and the items it replaced (an undelivered summary it replaces leaves the
--   queue instead: the app never held it). One made in the open turn is in its undo log.
--   Once a hard reset is requested (escalated before, not yet reset), a failed
--   compaction is not counted again: failures and x:failed_compactions stay at the
--   escalation's count until the reset.
-- Stream entries (see `enqueue`): on escalation kind=hard_reset session=<id> epoch=<n>
--   reason=failed_compactions op=<op id> inc=<the session's inc>; on a failure that does
--   not escalate, kind=compact (the compaction is retried: a new compaction request, a new
--   attempt) with reason=failed_compaction and the same other fields (the session's cq is
--   stamped), for worker-owned sessions only, none once a hard reset is requested, and none
--   for an agent's own compaction while one is pending already (cd = 1).
-- Errors: LEDGER_BADARG, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED,
--         LEDGER_CONFLICT (the summary id is held and not among the replaced items, or
--         only in another version than the one given),
--         LEDGER_TURNHELD, LEDGER_TURNLOST (an agent's compaction, see `fence` in _common.lua).
-- Calls: HMGET, XDEL (a job), TIME, HDEL, HSET, HGET and XADD (on escalation or retry), HINCRBY,
--        PEXPIRE (of KEYS[3] and KEYS[4], with a summary text).

local op, fp, epoch, tok = op_args('compact', false)
local sid, sum_id, sum_t, n
sid = session_arg(ARGV[3])
sum_id = id_arg(ARGV[4], 'summary item id')
sum_t = int_arg(ARGV[5], 'summary tokens', 0, TOKENS_MAX)
n = int_arg(ARGV[6], 'item count', 0, 1000)
if #ARGV ~= 8 + n then
  fail('BADARG', 'expected ' .. (8 + n) .. ' arguments for ' .. n .. ' items, got ' .. #ARGV)
end
local text = ARGV[8 + n] ~= '' and ARGV[8 + n] or nil
-- A stream entry id: two unsigned 64-bit decimals (an id XDEL would refuse is a BADARG).
local job = ARGV[7 + n]
local function u64(d)  -- canonical: no leading zero
  return d and (d == '0' or string.sub(d, 1, 1) ~= '0') and
    (#d < 20 or (#d == 20 and d <= '18446744073709551615'))
end
if job ~= '-' then
  local ms, seq = string.match(type(job) == 'string' and job or '', '^(%d+)%-(%d+)$')
  if not (u64(ms) and u64(seq)) then
    fail('BADARG', 'job entry id must be <ms>-<seq> or -, got ' .. show(job))
  end
end
local NUM = { 'ep', 'tn', 'sq', 'W', 'S', 'T', 'out', 'F_w', 'F_rm', 'a_w', 'a_rm', 'a_s', 'u_w', 'u_r', 'u_m',
  'u_s', 'n_w', 'n_r', 'n_m', 'n_s', 'HW', 'kf', 'kn', 'cx', 'rq', 'gz', 'xp', 'kg', 'cd', 'oq' }
local fields = { 'i:w:' .. sum_id }
for i = #NUM, 1, -1 do table.insert(fields, 1, NUM[i]) end
local seen, refs = {}, {}
for k = 1, n do
  local raw = type(ARGV[6 + k]) == 'string' and ARGV[6 + k] or ''
  local body, ver = string.match(raw, '^(.-)|(%d+)$')
  local c, id = string.match(body or raw, '^([wrms]):(.+)$')
  if not c then
    fail('BADARG', 'replaced item must be <c>:<id> or <c>:<id>|<seq> with c in wrms, got ' .. show(raw))
  end
  id = id_arg(id, 'item id')
  if ver then ver = int_arg(ver, 'sequence number', 1, 1e15, id) end
  local ref = c .. ':' .. id
  if seen[ref] then fail('BADARG', 'item ' .. id .. ' of ' .. consumer_name(c) .. ' appears twice') end
  seen[ref] = true
  refs[k] = { c = c, id = id, ref = ref, ver = ver }
  fields[#fields + 1] = 'i:' .. ref
end
for _, f in ipairs({ 'lo', 'ul', 'qs', 'qd', 'le', 'uo' }) do fields[#fields + 1] = f end

key_arg(2, 'jobs', 'content:%s', 'compacted:%s')
local key = KEYS[1]
local H, R = load(key, fields, #NUM)
local lo, ul, qs, qd, le, uo = R[n + 2], R[n + 3], R[n + 4], R[n + 5], R[n + 6], R[n + 7]
local again = gate(recorded(op), H.ep, op, fp, epoch)
if again then return again end
local in_turn = false
if job ~= '-' then
  if lo then
    return reply({ 'status=ok', 'outcome=turn_open', 'occupancy=' .. (H.S + H.T + H.a_w + H.a_rm + H.a_s),
      'high_water=' .. H.HW, 'dropped=0', 'summary=0', 'missing=', 'failures=' .. H.kf, 'escalated=0',
      'free=' .. free_room(H, H.out, H.a_w, H.a_rm, H.a_s),
      'epoch=' .. H.ep, 'turn=' .. H.tn, 'owner=' .. lo, 'lease=' .. (le or 0) })
  end
else
  in_turn = fence(key, lo, H.tn, tok)
end
-- The replaced items at the versions given (an item held in another version stays).
local matched = {}
for k = 1, n do
  local sq = string.match(R[1 + k] or '', '^%d+|%d+|%d+|(%d+)$')
  matched[k] = R[1 + k] and (not refs[k].ver or tonumber(sq) == refs[k].ver) or false
end
local replaces_summary = false
for k = 1, n do
  if refs[k].ref == 'w:' .. sum_id and matched[k] then replaces_summary = true end
end
if R[1] and not replaces_summary then
  fail('CONFLICT', 'working memory already holds ' .. sum_id .. ' and it is not being replaced' ..
    (seen['w:' .. sum_id] and ' (it is held in another version than the one given)' or ''))
end
-- Every check is done. A job's entry is deleted here, with the effect: when XDEL deletes
-- nothing (the entry is gone) nothing has been written and the call replies 'already'.
if job ~= '-' and redis.call('XDEL', KEYS[2], job) == 0 then
  return reply({ 'status=ok', 'outcome=already', 'occupancy=' .. (H.S + H.T + H.a_w + H.a_rm + H.a_s),
    'high_water=' .. H.HW, 'dropped=0', 'summary=0', 'missing=', 'failures=' .. H.kf, 'escalated=0',
    'free=' .. free_room(H, H.out, H.a_w, H.a_rm, H.a_s),
    'epoch=' .. H.ep, 'turn=' .. H.tn })
end
local now = now_ms()
local J = { gz = H.gz, xp = H.xp, uo = in_turn and (uo or '') or nil }
local A = { a_w = H.a_w, a_rm = H.a_rm, a_s = H.a_s }
local U = { w = H.u_w, r = H.u_r, m = H.u_m, s = H.u_s }
local N = { w = H.n_w, r = H.n_r, m = H.n_m, s = H.n_s }
local dropped, dead, was, gone, missing = 0, {}, {}, {}, {}
for k = 1, n do
  local rec, c = R[1 + k], refs[k].c
  if matched[k] then
    local t = tonumber(string.match(rec, '^(%d+)|'))
    dropped = dropped + t
    A[ACTIVE[c]], U[c], N[c] = A[ACTIVE[c]] - t, U[c] - t, N[c] - 1
    dead[#dead + 1] = fields[#NUM + 1 + k]
    was[#dead], gone[#dead] = rec, refs[k].ref
  else
    missing[#missing + 1] = refs[k].ref
  end
end
A.a_w = A.a_w + sum_t
local fr = free_room(H, H.out, A.a_w, A.a_rm, A.a_s)
-- A summary that does not fit cannot be applied (that would over-allocate): it is a
-- failed compaction with no effect, judged like one that misses the mark.
local fits = fr >= 0
if not fits then
  A = { a_w = H.a_w, a_rm = H.a_rm, a_s = H.a_s }
  U = { w = H.u_w, r = H.u_r, m = H.u_m, s = H.u_s }
  N = { w = H.n_w, r = H.n_r, m = H.n_m, s = H.n_s }
  fr = free_room(H, H.out, A.a_w, A.a_rm, A.a_s)
  dead, was, gone, dropped, sum_t = {}, {}, {}, 0, 0
end
local occ = H.S + H.T + A.a_w + A.a_rm + A.a_s
local gain = H.S + H.T + H.a_w + H.a_rm + H.a_s - occ
local deferred = fits and occ <= H.HW and gain < (H.kg or 0)  -- bought too little: a deferral
-- rule: post-condition (the demo's rule tests replace the next line)
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
  -- (a working-memory item has no entry in the reclaim-order index: it stays complete)
  if H.oq == H.sq then args[#args + 1], args[#args + 2] = 'oq', sq end
end
local upd = { 'sq', sq, 'a_w', A.a_w, 'a_rm', A.a_rm, 'a_s', A.a_s, 'fr', fr, 'kf', kf, 'cd', ok and 0 or 1 }
for _, c in ipairs({ 'w', 'r', 'm', 's' }) do
  upd[#upd + 1], upd[#upd + 2], upd[#upd + 3], upd[#upd + 4] = 'u_' .. c, U[c], 'n_' .. c, N[c]
end
for i = 1, #upd do args[#args + 1] = upd[i] end
if in_turn then
  if #dead > 0 then args[#args + 1], args[#args + 2] = 'ul', journal(ul, dead, was) end
elseif #dead > 0 or sum_t > 0 then
  -- Deliveries for the next turn: the summary and what it replaced, except a summary not
  -- delivered yet, which leaves the queue (the items it replaced are queued already).
  local pending = {}
  for id in string.gmatch(qs or '', '[^,]+') do pending[id] = true end
  local drops = {}
  for _, ref in ipairs(gone) do
    local wid = string.match(ref, '^w:(.+)$')
    if wid and pending[wid] then pending[wid] = nil else drops[#drops + 1] = ref end
  end
  local keep = {}
  for id in string.gmatch(qs or '', '[^,]+') do if pending[id] then keep[#keep + 1] = id end end
  if sum_t > 0 then keep[#keep + 1] = sum_id end
  args[#args + 1], args[#args + 2] = 'qs', table.concat(keep, ',')
  args[#args + 1], args[#args + 2] = 'qd', cat(qd, table.concat(drops, ','))
end
if ok then
  args[#args + 1], args[#args + 2], args[#args + 3], args[#args + 4] = 'kn', H.kn + 1, 'kt', H.tn
elseif H.rq == 0 then
  indicate(key, 'failed_compactions', 1)
end
if fits and not in_turn and #gone > 0 then
  redis.call('HDEL', KEYS[3], unpack(gone))
  local olds = {}
  for _, ref in ipairs(gone) do olds[#olds + 1] = string.match(ref, '^w:(.+)$') end
  if #olds > 0 then redis.call('HDEL', KEYS[4], unpack(olds)) end
end
if text and sum_t > 0 then
  local quoted = {}
  for i, ref in ipairs(gone) do quoted[i] = '"' .. ref .. '"' end  -- ids need no escapes
  put(KEYS[4], { sum_id, '{"text":' .. cjson.encode(text) .. ',"replaced":[' ..
    table.concat(quoted, ',') .. '],"at":' .. string.format('%d', now) .. '}' }, J, key)
  put(KEYS[3], { 'w:' .. sum_id, text }, J, key)
end
if escalate then
  enqueue(KEYS[2], 'hard_reset', sid, H.ep, op, 'failed_compactions')
  indicate(key, 'escalations', 1)
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
