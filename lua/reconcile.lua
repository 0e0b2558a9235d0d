-- reconcile.lua: set consumers' items to exactly those the real prompt holds, atomically.
--
-- For each consumer named in ARGV[3], its items become exactly the listed ones: an item
-- not listed is released, a listed item not held is added (at this turn), a held item
-- takes the listed tokens and priority (keeping its turn; another size is another
-- version: it takes a new sequence number). Consumers not
-- named, open reservations, the system prompt and the framing are untouched. The result
-- must fit the window with every floor (else refused, nothing changed): the ledger never
-- over-allocates, so a prompt that does not fit must be cut by the caller first. A
-- flagged drift (field df, see end_turn.lua) is cleared: the counters now describe the prompt.
-- Deliveries queued for the next turn that the prompt contradicts are dropped (a summary
-- it does not hold, an item to drop that it holds).
--
-- KEYS[1]  session hash
-- KEYS[2]  partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[3]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[4]  previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch[@turn]             integer; older than the session's -> LEDGER_STALE; @turn:
--                                  a call of that turn (see `fence`)
-- ARGV[3]  consumers               the consumers being set, letters of wrms, each at most once
-- ARGV[4]  n                       number of items, 0..1000
-- ARGV[5..4+4n]  n quadruples      consumer (one of ARGV[3]), item id, tokens (1..1e8),
--                                  priority (0..1000)
--
-- Mode: mutating
-- Reply: status=ok|added=<n>|resized=<n>|kept=<n>|removed=<c:id,...>|delta=<tokens>
--          |free=<tokens>|epoch=<n>|turn=<n>
--    or  status=refused|reason=token_budget_exhausted|requested=<tokens>|free=<tokens>
--          |epoch=<n>|turn=<n>   (requested: the listed items' tokens)
-- Errors: LEDGER_BADARG (also: an item twice, an item of a consumer not named),
--         LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED, LEDGER_TURNHELD, LEDGER_TURNLOST
--         (see `fence` in _common.lua).
-- Calls: HMGET, TIME, HGETALL, HDEL, HSET, HINCRBY (HMGET of the op's outcome bucket and the epoch base e, HSET of the bucket; a PEXPIRE, or the outcome generations' RENAME and PEXPIRE, when due).

local op, fp, epoch, tok = op_args('reconcile', false)
local set = ARGV[3]
if type(set) ~= 'string' or not string.match(set, '^[wrms]+$') or #set > 4 then
  fail('BADARG', 'consumers must be 1-4 letters of wrms, got ' .. show(set))
end
local named = {}
for c in string.gmatch(set, '.') do
  if named[c] then fail('BADARG', 'consumer ' .. consumer_name(c) .. ' is named twice') end
  named[c] = true
end
local n
n = int_arg(ARGV[4], 'item count', 0, 1000)
if #ARGV ~= 4 + 4 * n then
  fail('BADARG', 'expected ' .. (4 + 4 * n) .. ' arguments for ' .. n .. ' items, got ' .. #ARGV)
end
local want, seen, total = {}, {}, 0
for k = 1, n do
  local b = 1 + 4 * k
  local c, id, t, p
  c = consumer_arg(ARGV[b])
  if not named[c] then fail('BADARG', consumer_name(c) .. ' has an item but is not among the consumers reconciled') end
  id = id_arg(ARGV[b + 1], 'item id')
  local f = 'i:' .. c .. ':' .. id
  if seen[f] then fail('BADARG', 'item ' .. id .. ' of ' .. consumer_name(c) .. ' appears twice') end
  seen[f] = true
  t = int_arg(ARGV[b + 2], 'tokens', 1, TOKENS_MAX, id)
  p = int_arg(ARGV[b + 3], 'priority', 0, 1000, id)
  total = total + t
  want[#want + 1] = { f = f, c = c, t = t, p = p }
end

local key = KEYS[1]
local H, R = load(key, { 'ep', 'tn', 'sq', 'fr', 'W', 'S', 'T', 'out', 'F_w', 'F_rm', 'u_w', 'u_r', 'u_m',
  'u_s', 'n_w', 'n_r', 'n_m', 'n_s', 'v_w', 'v_r', 'v_m', 'v_s', 'gz', 'xp', 'lo', 'ul', 'df', 'uo', 'qs', 'qd' }, 24)
local again = gate(recorded(op), H.ep, op, fp, epoch)
if again then return again end
local in_turn = fence(key, R[1], H.tn, tok)
local logged, was = { 'df' }, { R[3] }  -- (a flagged drift it clears comes back with a rollback)
local now = now_ms()
local J = { gz = H.gz, xp = H.xp, uo = in_turn and (R[4] or '') or nil }

-- The named consumers' items as held now.
local held = {}
local all = redis.call('HGETALL', key)
for i = 1, #all, 2 do
  local c = string.match(all[i], '^i:(%a):')
  if c and named[c] then held[all[i]] = all[i + 1] end
end
local U = { w = H.u_w, r = H.u_r, m = H.u_m, s = H.u_s }
local N = { w = H.n_w, r = H.n_r, m = H.n_m, s = H.n_s }
for c in pairs(named) do U[c], N[c] = 0, 0 end
local sq, args, added, resized, kept = H.sq, {}, 0, 0, 0
for _, it in ipairs(want) do
  U[it.c], N[it.c] = U[it.c] + it.t, N[it.c] + 1
  local rec = held[it.f]
  if rec then
    local t, tn, p, s = string.match(rec, '^(%d+)|(%d+)|(%d+)|(%d+)$')
    if tonumber(t) ~= it.t or tonumber(p) ~= it.p then
      resized = resized + 1
      -- another size is another text: a new version (a compaction of the old one leaves it)
      if tonumber(t) ~= it.t then sq, s = sq + 1, sq + 1 end
      args[#args + 1], args[#args + 2] = it.f, table.concat({ it.t, tn, it.p, s }, '|')
      logged[#logged + 1], was[#logged + 1] = it.f, rec
    else
      kept = kept + 1
    end
    held[it.f] = nil
  else
    sq = sq + 1
    added = added + 1
    args[#args + 1], args[#args + 2] = it.f, table.concat({ it.t, H.tn, it.p, sq }, '|')
  end
end
local dead, removed = {}, {}
for f, rec in pairs(held) do
  dead[#dead + 1] = f
  removed[#removed + 1] = string.sub(f, 3)
  logged[#logged + 1], was[#logged + 1] = f, rec
end
table.sort(removed)
local a_w = U.w + H.v_w
local a_rm = U.r + H.v_r + U.m + H.v_m
local a_s = U.s + H.v_s
local fr = free_room(H, H.out, a_w, a_rm, a_s)
if fr < 0 then
  indicate(key, 'refused', 1)
  return commit(key, now, op, fp, table.concat({ 'status=refused|reason=token_budget_exhausted',
    '|requested=', total, '|free=', H.fr, '|epoch=', H.ep, '|turn=', H.tn }), {}, J)
end
local delta = (U.w + U.r + U.m + U.s) - (H.u_w + H.u_r + H.u_m + H.u_s)
-- Deliveries queued for the next turn (a worker's compaction since the last one) that
-- this contradicts go: an item to drop that the prompt holds, a summary it does not hold.
-- The prompt is the truth now; the compaction due comes again at the next turn's end.
local wanted = {}
for _, it in ipairs(want) do wanted[it.f] = true end
local qs, qd = {}, {}
for id in string.gmatch(R[5] or '', '[^,]+') do
  if not (named.w and not wanted['i:w:' .. id]) then qs[#qs + 1] = id end
end
for ref in string.gmatch(R[6] or '', '[^,]+') do
  local c = string.sub(ref, 1, 1)
  if not (named[c] and wanted['i:' .. ref]) then qd[#qd + 1] = ref end
end
if R[5] then args[#args + 1], args[#args + 2] = 'qs', table.concat(qs, ',') end
if R[6] then args[#args + 1], args[#args + 2] = 'qd', table.concat(qd, ',') end
call_each('HDEL', key, dead)
indicate(key, 'reconciled', 1)
local upd = { 'sq', sq, 'fr', fr, 'a_w', a_w, 'a_rm', a_rm, 'a_s', a_s, 'df', 0 }
for _, c in ipairs({ 'w', 'r', 'm', 's' }) do
  upd[#upd + 1], upd[#upd + 2], upd[#upd + 3], upd[#upd + 4] = 'u_' .. c, U[c], 'n_' .. c, N[c]
end
for i = 1, #upd do args[#args + 1] = upd[i] end
if in_turn then args[#args + 1], args[#args + 2] = 'ul', journal(R[2], logged, was) end
return commit(key, now, op, fp, table.concat({ 'status=ok|added=', added, '|resized=', resized,
  '|kept=', kept, '|removed=', table.concat(removed, ','), '|delta=', delta, '|free=', fr,
  '|epoch=', H.ep, '|turn=', H.tn }), args, J)
