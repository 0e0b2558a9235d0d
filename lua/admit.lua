-- admit.lua: admit a batch of named items for one consumer, in one atomic step.
--
-- KEYS[1]  session hash
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  argument fingerprint    hex, computed by the client over ARGV[3..]
-- ARGV[3]  epoch                   integer; older than the session's -> LEDGER_STALE
-- ARGV[4]  consumer                w | r | m | s
-- ARGV[5]  mode                    all: every new item or none;
--                                  prefix: the longest prefix that fits, the rest skipped
-- ARGV[6]  n                       number of items, 1..1000
-- ARGV[7..6+3n]  n triples         item id, tokens (1..1e8), priority (0..1000)
--
-- Reply: status=ok|charged=<tokens>|admitted=<n>|duplicates=<n>|skipped=<id,...>
--          |free=<tokens>|epoch=<n>|turn=<n>
--    or  status=refused|reason=<reason>|requested=<tokens>|free=<tokens>|epoch=<n>|turn=<n>
--   reason: token_budget_exhausted; floor_protected (the room exists but lies inside
--   another consumer's floor); compaction_pending (retrieval or recall while a
--   compaction is pending: judged on the post-compaction baseline, occupancy at the
--   high-water mark, record 001).
-- An item id the consumer already holds charges nothing (a duplicate). A refusal
-- changes no allocation; its outcome is kept under the op id like any other.
-- 'all' is refused when the new items do not fit together; 'prefix' when not even
-- the first new item fits (requested is then that item's tokens).
-- Errors: LEDGER_BADARG, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED.
-- Calls: HMGET, TIME, HSET (a PEXPIRE or a journal sweep when due; HINCRBY on refusal).

local op, fp, epoch, e = op_args(false)
if e then return e end
local c
c, e = consumer_arg(ARGV[4])
if e then return e end
local mode = ARGV[5]
if mode ~= 'all' and mode ~= 'prefix' then
  return err('BADARG', 'mode must be all or prefix, got ' .. show(mode))
end
local n
n, e = int_arg(ARGV[6], 'item count', 1, 1000)
if e then return e end
if #ARGV ~= 6 + 3 * n then
  return err('BADARG', 'expected ' .. (6 + 3 * n) .. ' arguments for ' .. n .. ' items, got ' .. #ARGV)
end
local g = GROUP[c]
local A, F, U, N = 'a_' .. g, 'F_' .. g, 'u_' .. c, 'n_' .. c
local raws, toks, prios, seen = { 'ep', 'tn', 'sq', 'fr', A, F, U, N, 'gz', 'xp', 'cd', 'o:' .. op, 'ol' }, {}, {}, {}
for k = 1, n do
  local b = 4 + 3 * k
  local id
  id, e = id_arg(ARGV[b], 'item id')
  if e then return e end
  if seen[id] then return err('BADARG', 'item id ' .. id .. ' appears twice in the batch') end
  seen[id] = true
  toks[k], e = int_arg(ARGV[b + 1], 'tokens', 1, TOKENS_MAX, id)
  if e then return e end
  prios[k], e = int_arg(ARGV[b + 2], 'priority', 0, 1000, id)
  if e then return e end
  raws[k + 13] = 'i:' .. c .. ':' .. id
end

local key = KEYS[1]
local H, R = load(key, raws, 11)
e = gate(H, R, op, fp, epoch)
if e then return e end
local now = now_ms()

local a, floor = H[A], H[F] or 0
local charged, admitted, dups, skipped, args = 0, 0, 0, {}, {}
local fr = H.fr
-- Record 001: while a compaction is pending, memory is judged on the post-compaction
-- baseline (occupancy at the high-water mark): at most W - out - HW tokens of it.
local cap, pending = nil, g == 'm' and H.cd == 1
if pending then
  local x = load(key, { 'HW', 'out', 'W' }, 3)
  cap = x.W - x.out - x.HW
end
local wanted, first_skip = 0, nil
for k = 1, n do
  if R[k + 2] then
    dups = dups + 1
  else
    local d = claim_delta(a + charged, toks[k], floor)
    wanted = wanted + toks[k]
    if mode == 'prefix' and (#skipped > 0 or d > fr or (cap and charged + toks[k] > cap)) then
      skipped[#skipped + 1] = ARGV[4 + 3 * k]
      first_skip = first_skip or toks[k]
    else
      fr = fr - d
      charged = charged + toks[k]
      admitted = admitted + 1
      H.sq = H.sq + 1
      args[#args + 1] = raws[k + 13]
      args[#args + 1] = table.concat({ toks[k], H.tn, prios[k], H.sq }, '|')
    end
  end
end
local J = { ol = R[2], gz = H.gz, xp = H.xp }
-- Refused: 'all' mode that does not fit whole; 'prefix' mode that fits nothing.
local refused = (mode == 'all' and (fr < 0 or (cap and charged > 0 and charged > cap))) or (mode == 'prefix' and admitted == 0
  and #skipped > 0)
if refused then
  local asked = mode == 'all' and charged or first_skip
  local reason = pending and 'compaction_pending' or refusal_reason(key, asked)
  redis.call('HINCRBY', key, 'x:refused', 1)
  return commit(key, now, op, fp, table.concat({ 'status=refused|reason=', reason, '|requested=', asked,
    '|free=', H.fr, '|epoch=', H.ep, '|turn=', H.tn }), {}, J)
end
if admitted > 0 then
  local m = #args
  args[m + 1], args[m + 2], args[m + 3], args[m + 4], args[m + 5] = 'sq', H.sq, 'fr', fr, A
  args[m + 6], args[m + 7], args[m + 8], args[m + 9], args[m + 10] = a + charged, U, H[U] + charged, N, H[N] + admitted
end
return commit(key, now, op, fp, table.concat({ 'status=ok|charged=', charged, '|admitted=', admitted,
  '|duplicates=', dups, '|skipped=', table.concat(skipped, ','), '|free=', fr, '|epoch=', H.ep,
  '|turn=', H.tn }), args, J)
