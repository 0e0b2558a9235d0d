-- admit.lua: admit a batch of named items for one consumer, in one atomic step.
--
-- KEYS[1]  session hash
-- KEYS[2]  content store           '<tag>:content:<session>'
-- KEYS[3]  (optional) reclaim-order index  '<tag>:order:<session>': kept when sent (see
--          ORDER in _common.lua); without it the next reclaiming turn rebuilds it
-- KEYS[-3] partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[-2] outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[-1] previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch[@turn]             integer; older than the session's -> LEDGER_STALE; @turn:
--                                  a call of that turn (see `fence`)
-- ARGV[3]  consumer                w | r | m | s
-- ARGV[4]  mode                    all: every new item or none;
--                                  prefix: the longest prefix that fits, the rest skipped;
--                                  either followed by '+text' when the items' texts follow
-- ARGV[5]  n                       number of items, 1..1000
-- ARGV[6..5+3n]  n triples         item id, tokens (1..1e8), priority (0..1000)
-- ARGV[6+3n..5+4n]  n texts        with '+text' only: the items' texts, in order (part of
--                                  the op fingerprint). Each item this call admits gets its
--                                  text in the content store ('<c>:<item id>'), in the same
--                                  step (a duplicate or a skipped item's text is not written)
--
-- KEYS count: 5; 6 with the order index
-- Mode: mutating
-- Reply: status=ok|charged=<tokens>|admitted=<n>|duplicates=<n>|skipped=<id,...>
--          |free=<tokens>|epoch=<n>|turn=<n>
--    or  status=refused|reason=<reason>|requested=<tokens>|free=<tokens>|epoch=<n>|turn=<n>
--   reason: token_budget_exhausted; floor_protected (the room exists but lies inside
--   another consumer's floor); compaction_pending (retrieval or recall while a
--   compaction is pending, docs/rules.md#compaction-credit: refused outright while
--   the last compaction failed to reach H (failed, did_not_fit, stale: kf > 0 and kr
--   not kf), bound=failed; else (after a deferral too) judged on the post-compaction
--   baseline, bound=pending: H + memory admitted since the compaction became pending + the
--   request + the turn's output reserve must not exceed the window). A request that
--   passes that bound but not the free room gets the free-room reason
--   (token_budget_exhausted or floor_protected), never compaction_pending.
--   A compaction_pending refusal adds |bound=<pending|failed>|baseline=<tokens> (H + pm).
-- An item id the consumer already holds charges nothing (a duplicate). A refusal
-- changes no allocation; its outcome is kept under the op id like any other.
-- 'all' is refused when the new items do not fit together; 'prefix' when not even
-- the first new item fits (requested is then that item's tokens).
-- Errors: LEDGER_BADARG, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED, LEDGER_TURNHELD,
--         LEDGER_TURNLOST (see `fence` in _common.lua).
-- Calls: HMGET, TIME, HSET (ZADD of the reclaim-order index when sent, HGET of ttl and its PEXPIRE when due; HSET and PEXPIRE of the content store when texts are sent; HMGET of the op's outcome bucket and the epoch base e, HSET of the bucket; a PEXPIRE, or the outcome generations' RENAME and PEXPIRE, when due; HINCRBY on refusal;
--        HMGET of HW, out, W, kf, pm, kr for retrieval and recall while a compaction is pending).

local op, fp, epoch, tok = op_args('admit', false)
local c
c = consumer_arg(ARGV[3])
local mode, texts = ARGV[4], false
if mode == 'all+text' or mode == 'prefix+text' then mode, texts = string.sub(mode, 1, -6), true end
if mode ~= 'all' and mode ~= 'prefix' then
  fail('BADARG', 'mode must be all or prefix, optionally followed by +text, got ' .. show(ARGV[4]))
end
local n
n = int_arg(ARGV[5], 'item count', 1, 1000)
local want = 5 + (texts and 4 or 3) * n
if #ARGV ~= want then
  fail('BADARG', 'expected ' .. want .. ' arguments for ' .. n .. ' items' ..
    (texts and ' and their texts' or '') .. ', got ' .. #ARGV)
end
local ORD = #KEYS == 6 and KEYS[3] or nil
-- key_arg(2, 'content:%s'[, 'order:%s']), its test spelled out on the tag and session id
-- op_args checked (two joins, not a match and a format per key); key_arg, which fails the
-- same way, gives the message.
local pre = KEY_TAG .. ':'
if #KEYS ~= (ORD and 6 or 5) or KEYS[2] ~= pre .. 'content:' .. KEY_SID or
    (ORD and ORD ~= pre .. 'order:' .. KEY_SID) then
  if ORD then key_arg(2, 'content:%s', 'order:%s') else key_arg(2, 'content:%s') end
end
-- This is the hot path: fields are read by position, not through load()'s tables; the
-- claim group's fields are ACTIVE[c] and FLOOR[c], spelled out (those tables are not built).
local A, F, U, N = 'a_rm', 'F_rm', 'u_' .. c, 'n_' .. c
if c == 'w' then A, F = 'a_w', 'F_w' elseif c == 's' then A, F = 'a_s', 'F_s' end
local fields = { 'ep', 'tn', 'sq', 'fr', A, F, U, N, 'gz', 'xp', 'cd', 'lo', 'uo', 'oq', 'ox', 'lv' }
local toks, seen = {}, n > 1 and {} or nil
for k = 1, n do
  local b = 3 + 3 * k
  local id
  id = id_arg(ARGV[b], 'item id')
  if seen then
    if seen[id] then fail('BADARG', 'item id ' .. id .. ' appears twice in the batch') end
    seen[id] = true
  end
  toks[k] = int_arg(ARGV[b + 1], 'tokens', 1, TOKENS_MAX, id)
  int_arg(ARGV[b + 2], 'priority', 0, 1000, id)
  fields[k + 16] = 'i:' .. c .. ':' .. id
end
-- (with texts, the session's idle TTL and op retention too, for the content store's TTL:
-- read here, not by put's own HMGET)
if texts then fields[n + 17], fields[n + 18] = 'ttl', 'ort' end

local key = KEYS[1]
local v = redis.call('HMGET', key, unpack(fields))
-- v: 1 ep, 2 tn, 3 sq, 4 fr, 5 a, 6 floor, 7 u, 8 n, 9 gz, 10 xp, 11 cd, 12 lo, 13 uo,
-- 14 oq, 15 ox, 16 lv, 16 + k: item k when already held.
-- (numbers as stored, converted by arithmetic: + 0 converts once, tonumber twice)
local again = gate(recorded(op), v[1] and v[1] + 0, op, fp, epoch, v[16])
if again then return again end
local in_turn = (tok or v[12]) and fence(key, v[12], v[2], tok) or false  -- (no turn, none open: no call)
local ep, tn = v[1], v[2]  -- kept as text: the reply and the items repeat them
local now = now_ms()

local a, floor, sq, fr = v[5] + 0, v[6] and v[6] + 0 or 0, v[3] + 0, v[4] + 0
local fr0 = fr
-- (skipped: made at the first item skipped; stored: only with texts)
local charged, admitted, dups, skipped, items, stored = 0, 0, 0, nil, {}, texts and {} or nil
local sqs, ts  -- the last admitted item's sequence number and tokens, as text
-- Compaction credit (docs/rules.md#compaction-credit): while a compaction is pending,
-- memory is judged on the post-compaction baseline: the high-water mark plus the
-- memory admitted since the compaction became pending (pm); at most W - out - HW - pm
-- more tokens. None while the last one failed to reach H (failed, did_not_fit, stale);
-- after a deferral (it reached H, but freed less than the minimum gain) the bound. The
-- bound is the tighter of the two only where memory was released since the compaction became pending (a consumer released
-- each turn), memory has a floor (min_memory), or the compaction was made due below H
-- (a starvation refusal): with memory kept (sticky) occupancy stays above H while a
-- compaction is pending, so the free room refuses first.
local cap, pending, bound, pm, base = nil, A == 'a_rm' and v[11] == '1', nil, 0, 0
if pending then
  local x = redis.call('HMGET', key, 'HW', 'out', 'W', 'kf', 'pm', 'kr')
  pm = tonumber(x[5]) or 0
  base = tonumber(x[1]) + pm
  -- rule: pending-compaction-bound (the demo's rule tests replace the next line)
  cap = tonumber(x[3]) - tonumber(x[2]) - base
  bound = 'pending'
  -- (a deferral reached H: it counts in kf, but its baseline holds; kr = kf while it is
  -- the last compaction judged, so a failure after it, even one an older release judged, ends that)
  if (tonumber(x[4]) or 0) > 0 and x[6] ~= x[4] then cap, bound = 0, 'failed' end
end
local first_skip, by_bound = nil, false
-- z: the members of the items admitted, when the reclaim-order index is kept here (see
-- order_keep; zb: the score's consumer part, ORDER[c] * ORDER_SPAN, spelled out: c is not
-- working memory, whose items the index does not hold)
local z = v[14] == v[3] and ORD and c ~= 'w' and {} or nil
local zb = z and ORDER_SPAN * (c == 'r' and 1 or c == 'm' and 2 or 0)
for k = 1, n do
  local t = toks[k]
  if v[k + 16] then
    dups = dups + 1
  else
    -- (claim_delta(x, t, floor), inline: max(x + t, floor) - max(x, floor))
    local x = a + charged
    local d = (x + t > floor and x + t or floor) - (x > floor and x or floor)
    local over = cap and charged + t > cap
    if mode == 'prefix' and (skipped or d > fr or over) then
      if not first_skip then first_skip, by_bound, skipped = t, over, {} end
      skipped[#skipped + 1] = ARGV[3 + 3 * k]
    else
      fr = fr - d
      charged = charged + t
      admitted = admitted + 1
      sq = sq + 1
      -- tokens and priority as sent: int_arg took them only written canonically, as %d
      -- would write them; the turn as read
      local b = 3 + 3 * k
      sqs, ts = string.format('%d', sq), ARGV[b + 1]
      items[#items + 1] = fields[k + 16]
      items[#items + 1] = ARGV[b + 1] .. '|' .. tn .. '|' .. ARGV[b + 2] .. '|' .. sqs
      if z then z[#z + 1], z[#z + 2] = string.format('%d', zb + sq), fields[k + 16] end
      if texts then
        stored[#stored + 1] = c .. ':' .. ARGV[b]  -- '<c>:<id>'
        stored[#stored + 1] = ARGV[5 + 3 * n + k]
      end
    end
  end
end
local J = { gz = v[9] + 0, xp = v[10] + 0, uo = in_turn and (v[13] or '') or nil }
if texts then J.ttl, J.ort = tonumber(v[n + 17]), tonumber(v[n + 18]) end
-- Refused: 'all' mode that does not fit whole; 'prefix' mode that fits nothing.
if mode == 'all' then by_bound = cap ~= nil and charged > 0 and charged > cap end
local refused = (mode == 'all' and (fr < 0 or by_bound)) or
  (mode == 'prefix' and admitted == 0 and skipped ~= nil)
if refused then
  local asked = mode == 'all' and charged or first_skip
  local extra = ''
  local reason
  if by_bound then
    reason = 'compaction_pending'
    extra = '|bound=' .. bound .. '|baseline=' .. base
    indicate(key, 'refused_pending', 1)
  else
    reason = refusal_reason(key, asked)
  end
  indicate(key, 'refused', 1)
  return commit(key, now, op, fp, table.concat({ 'status=refused|reason=', reason, '|requested=', asked,
    '|free=', fr0, '|epoch=', ep, '|turn=', tn, extra }), {}, J)
end
-- Each number is formatted once, with string.format's %d (one C call, faster than a
-- concatenation or redis.call turning a number into text): free for the field and the
-- reply. The reply is built, and coded as its outcome is stored (`store`), from the
-- same parts: no second pass over it.
local f, args = string.format, {}
local free = f('%d', fr)
if admitted > 0 then
  args = { 'sq', sqs, 'fr', free, A, f('%d', a + charged), U, f('%d', v[7] + charged),
    N, f('%d', v[8] + admitted), unpack(items) }
  if pending then args[#args + 1], args[#args + 2] = 'pm', f('%d', pm + charged) end
  if v[14] == v[3] then order_keep(ORD, c, v[14], v[3], sqs, z, v[15], now, key, args) end
end
if stored then put(KEYS[2], stored, J, key) end
-- (a count of 0 or 1, and the charge of one item, its tokens as sent, need no formatting)
local cs = admitted == 1 and ts or f('%d', charged)
local as = admitted == 1 and '1' or admitted == 0 and '0' or f('%d', admitted)
local ds = dups == 0 and '0' or dups == 1 and '1' or f('%d', dups)
local sk = skipped and table.concat(skipped, ',') or ''
-- (the codes of pack_codes: \1 status, \7 charged, \8 admitted, \9 duplicates,
-- \10 skipped, \4 free, \5 epoch, \6 turn)
return commit(key, now, op, fp, 'status=ok|charged=' .. cs .. '|admitted=' .. as ..
  '|duplicates=' .. ds .. '|skipped=' .. sk .. '|free=' .. free .. '|epoch=' .. ep .. '|turn=' .. tn,
  args, J, '\1ok\7' .. cs .. '\8' .. as .. '\9' .. ds .. '\10' .. sk .. '\4' .. free .. '\5', ep, '\6' .. tn)
