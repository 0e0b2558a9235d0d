-- compact.lua: commit a compaction of the session's history and judge it
-- (the compaction-credit rule, docs/rules.md#compaction-credit).
--
-- The compactor replaced some items (old working-memory turns, and stale retrieval
-- chunks or tool results, which are history too) by one working-memory summary. The post-
-- condition occupancy <= high-water mark is hard: a compaction that misses it is
-- a failed compaction. Its effect is still applied (the tokens are real), the
-- compaction stays pending, and after the configured number of consecutive failures
-- a hard-reset job is appended to the partition's job stream in this same step, so no
-- crash can lose the escalation. One that meets it but frees less than the session's
-- minimum gain is a deferral: counted toward the escalation as a failure, but it landed
-- under the mark: nothing is pending after it nor retried (the next end_turn above the
-- mark makes the next compaction due), and memory is judged on the post-compaction
-- bound, not refused, while the next one is pending (the session's kr, admit.lua).
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
-- ARGV[7..6+n]  replaced items  '<c>:<item id>' with c in w r m s, or '<c>:<item id>|<seq>':
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
-- ARGV[9+n] (optional) history read  the newest sequence number of the items the compactor
--                                  read, 0..1e15, or '-': the post-condition is judged on the
--                                  occupancy after the compaction less the items admitted
--                                  after it (the summary could not replace them)
--
-- When the effect is applied (every outcome but did_not_fit, already and staged), in the
-- same step: the texts of the replaced versions leave the content store and the records of
-- replaced summaries leave KEYS[4] (not for a compaction of the open turn, which a rollback
-- may undo); with a summary text and summary tokens > 0, KEYS[4] gets the summary's record,
-- JSON {"text":<text>,"replaced":["<c>:<id>",...],"at":<ms>} under its id (what the turn it
-- is delivered to reads), and the content store 'w:<summary id>' its text (what the next
-- compaction reads). An item held in another version keeps its text.
--
-- A recount: an agent's compaction in its open turn whose one replaced item is the summary
-- itself (ARGV[7] 'w:<summary id>', ARGV[4] that id, ARGV[5] > 0) gives the summary the
-- tokens ARGV[5] (the agent that received it counted its text): outcome recounted, no
-- compaction judged or counted, logged for the turn's rollback; did_not_fit when the new
-- count does not fit (nothing changed).
--
-- Mode: mutating
-- Reply: status=ok|outcome=<compacted|failed|deferred|did_not_fit|already|staged|recounted>
--          |occupancy=<tokens>|high_water=<tokens>|dropped=<tokens>|summary=<tokens>
--          |missing=<id,...>|failures=<n>|escalated=<0|1>|free=<tokens>|epoch=<n>|turn=<n>
--          |gain=<tokens>
--   outcome did_not_fit: the summary does not fit once the items are gone; nothing is
--   replaced, and it counts as a failed compaction. deferred: occupancy is at or under
--   the mark but the compaction freed (gain: occupancy before minus after) less than the
--   session's compaction min gain (kg); applied, and counted as a failed compaction
--   (failures, x:failed_compactions, the escalation), but no compaction is left pending
--   (cd = 0) and none is retried; the session's kr is set to the failure count it left
--   (kr = kf), so that while a compaction is pending and no failure followed it memory is
--   judged on the post-compaction bound, not refused (admit.lua).
--   Every other outcome judged here (compacted, failed, did_not_fit) sets kr to 0.
--   outcome already: the job entry named by ARGV[7+n] is no longer in the stream (its
--   compaction was committed before, or the entry was lost with its stream): nothing is
--   changed or stored; dropped=0, summary=0, missing empty, escalated=0, the other fields
--   as they are, and no gain.
--   outcome staged: a job's compaction while a turn is open (its lease held, or lapsed
--   and not yet rolled back): the job's entry is deleted and the plan stored in the
--   session's field kp (JSON: op, ep, id, t, items, text, read; replacing a plan staged
--   before), nothing else changes (a compaction never changes the prompt under a running
--   turn); the next begin_turn lands it before it gates its turn (see begin_turn.lua).
--   The fields are those of already, then |owner=<the turn's owner>|lease=<its end, ms>
--   (no gain).
--   A compaction that is not part of the open turn (a worker's job, or one made with no turn
--   while none is open) queues its deliveries for the next turn (fields qs, qd): the
--   summary, and the items it replaced (an undelivered summary it replaces leaves the
--   queue instead: the app never held it). One made in the open turn is in its undo log.
--   Once a hard reset is requested (escalated before, not yet reset), a failed
--   compaction is not counted again: failures and x:failed_compactions stay at the
--   escalation's count until the reset.
-- Stream entries (see `enqueue`): on escalation kind=hard_reset session=<id> epoch=<n>
--   reason=failed_compactions op=<op id> inc=<the session's inc>; on a failure that does
--   not escalate (not a deferral), kind=compact (the compaction is retried: a new compaction request, a new
--   attempt) with reason=failed_compaction and the same other fields (the session's cq is
--   stamped), for worker-owned sessions only, none once a hard reset is requested, and none
--   for an agent's own compaction while one is pending already (cd = 1).
-- Errors: LEDGER_BADARG, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED,
--         LEDGER_CONFLICT (the summary id is held and not among the replaced items, or
--         only in another version than the one given),
--         LEDGER_TURNHELD, LEDGER_TURNLOST (an agent's compaction, see `fence` in _common.lua).
-- Calls: HMGET, XDEL (a job), TIME, HDEL, HSET, HSCAN (with a history read), HGET and XADD (on escalation or retry), HINCRBY,
--        PEXPIRE (of KEYS[3] and KEYS[4], with a summary text).

local op, fp, epoch, tok = op_args('compact', false)
local sid, sum_id, sum_t, n
sid = session_arg(ARGV[3])
sum_id = id_arg(ARGV[4], 'summary item id')
sum_t = int_arg(ARGV[5], 'summary tokens', 0, TOKENS_MAX)
n = int_arg(ARGV[6], 'item count', 0, 1000)
if #ARGV ~= 8 + n and #ARGV ~= 9 + n then
  fail('BADARG', 'expected ' .. (8 + n) .. ' or ' .. (9 + n) .. ' arguments for ' .. n ..
    ' items, got ' .. #ARGV)
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
local read = nil
if #ARGV == 9 + n and ARGV[9 + n] ~= '-' then read = int_arg(ARGV[9 + n], 'history read', 0, 1e15) end
local list = {}
for k = 1, n do list[k] = ARGV[6 + k] end
local refs = plan_refs(list)
local fields = { 'i:w:' .. sum_id }
for i = #COMPACT_NUM, 1, -1 do table.insert(fields, 1, COMPACT_NUM[i]) end
for k = 1, n do fields[#fields + 1] = 'i:' .. refs[k].ref end
for _, f in ipairs({ 'lo', 'ul', 'qs', 'qd', 'le', 'uo' }) do fields[#fields + 1] = f end

key_arg(2, 'jobs', 'content:%s', 'compacted:%s')
local key = KEYS[1]
local H, R = load(key, fields, #COMPACT_NUM)
local lo, ul, qs, qd, le, uo = R[n + 2], R[n + 3], R[n + 4], R[n + 5], R[n + 6], R[n + 7]
local again = gate(recorded(op), H.ep, op, fp, epoch)
if again then return again end
local in_turn = job == '-' and fence(key, lo, H.tn, tok)
-- The replaced items at the versions given (an item held in another version stays).
local recs = {}
for k = 1, n do recs[k] = R[1 + k] end
local matched = plan_matched(refs, recs)
local named, replaces_summary = false, false
for k = 1, n do
  if refs[k].ref == 'w:' .. sum_id then named, replaces_summary = true, matched[k] end
end
if R[1] and not replaces_summary then
  fail('CONFLICT', 'working memory already holds ' .. sum_id .. ' and it is not being replaced' ..
    (named and ' (it is held in another version than the one given)' or ''))
end
local function unchanged(outcome, extra)
  local kv = { 'status=ok', 'outcome=' .. outcome, 'occupancy=' .. (H.S + H.T + H.a_w + H.a_rm + H.a_s),
    'high_water=' .. H.HW, 'dropped=0', 'summary=0', 'missing=', 'failures=' .. H.kf, 'escalated=0',
    'free=' .. free_room(H, H.out, H.a_w, H.a_rm, H.a_s), 'epoch=' .. H.ep, 'turn=' .. H.tn }
  for _, x in ipairs(extra) do kv[#kv + 1] = x end
  return reply(kv)
end
-- Every check is done. A job's entry is deleted here, with the effect: when XDEL deletes
-- nothing (the entry is gone) nothing has been written and the call replies 'already'.
if job ~= '-' and redis.call('XDEL', KEYS[2], job) == 0 then return unchanged('already', {}) end
local now = now_ms()
local J = { gz = H.gz, xp = H.xp, uo = in_turn and (uo or '') or nil }
if job ~= '-' and lo then
  -- A turn is open: the plan is staged (field kp, replacing one staged before) and lands
  -- at the session's next begin_turn, before that turn is gated.
  local plan = cjson.encode({ op = op, ep = string.format('%d', H.ep), id = sum_id,
    t = string.format('%d', sum_t), items = list, text = text or '',
    read = read and string.format('%d', read) or '-' })
  return commit(key, now, op, fp, unchanged('staged', { 'owner=' .. lo, 'lease=' .. (le or 0) }),
    { 'kp', plan }, J)
end
-- A summary replacing itself, in the open turn, is a recount: the agent the summary was
-- delivered to counts its text with its own counter and framing, and the item takes that
-- count (a new version, its turn and priority kept), logged for a rollback. No compaction
-- is judged or counted; one that does not fit changes nothing (did_not_fit).
if in_turn and n == 1 and refs[1].ref == 'w:' .. sum_id and matched[1] and sum_t > 0 then
  local old, tn0, p0 = string.match(recs[1], '^(%d+)|(%d+)|(%d+)|')
  local d = sum_t - tonumber(old)
  local fr = free_room(H, H.out, H.a_w + d, H.a_rm, H.a_s)
  local out = { 'status=ok', 'outcome=' .. (fr >= 0 and 'recounted' or 'did_not_fit'),
    'occupancy=' .. (H.S + H.T + H.a_w + H.a_rm + H.a_s + (fr >= 0 and d or 0)), 'high_water=' .. H.HW,
    'dropped=' .. (fr >= 0 and old or 0), 'summary=' .. (fr >= 0 and sum_t or 0), 'missing=',
    'failures=' .. H.kf, 'escalated=0', 'free=' .. (fr >= 0 and fr or free_room(H, H.out, H.a_w, H.a_rm, H.a_s)),
    'epoch=' .. H.ep, 'turn=' .. H.tn, 'gain=' .. (fr >= 0 and -d or 0) }
  local args = {}
  if fr >= 0 then
    local f, sq = 'i:w:' .. sum_id, H.sq + 1
    args = { f, table.concat({ sum_t, tn0, p0, sq }, '|'), 'sq', sq, 'a_w', H.a_w + d, 'u_w', H.u_w + d,
      'fr', fr, 'ul', journal(ul, { f }, { recs[1] }) }
    if H.oq == H.sq then args[#args + 1], args[#args + 2] = 'oq', sq end
  end
  return commit(key, now, op, fp, reply(out), args, J)
end
local args, V = compaction_effect(key, H, recs, matched, { refs = refs, sum_id = sum_id, sum_t = sum_t,
  text = text, read = read, in_turn = in_turn, ul = ul, qs = qs, qd = qd, job = job ~= '-', sid = sid,
  op = op, now = now, J = J }, { jobs = KEYS[2], content = KEYS[3], sums = KEYS[4] })
return commit(key, now, op, fp, table.concat({ 'status=ok|outcome=', V.outcome,
  '|occupancy=', V.occ, '|high_water=', H.HW, '|dropped=', V.dropped, '|summary=', V.sum_t, '|missing=',
  table.concat(V.missing, ','), '|failures=', V.kf, '|escalated=', V.escalate and 1 or 0, '|free=', V.fr,
  '|epoch=', H.ep, '|turn=', H.tn, '|gain=', V.gain }), args, J)
