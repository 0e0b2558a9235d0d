-- reserve.lua: hold an estimate for a consumer until a deadline (phase one of two).
--
-- KEYS[1]  session hash
-- KEYS[2]  partition deadline index  sorted set: score deadline ms, member '<session>|<reservation>'
-- KEYS[3]  partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[4]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[5]  previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch[@turn]             integer; older than the session's -> LEDGER_STALE; @turn:
--                                  a call of that turn (see `fence`)
-- ARGV[3]  session id              the member prefix in the deadline index
-- ARGV[4]  consumer                w | r | m | s
-- ARGV[5]  reservation id          [A-Za-z0-9._:/@+=#-]{1,128}, unique among open ones
-- ARGV[6]  tokens                  estimate, 1..1e8
-- ARGV[7]  lease                   milliseconds until the deadline, 1..86400000, on Redis's clock
-- (optional, a model call charged to budget scopes, docs/ceilings.md; KEYS[3..] are then
-- each scope's hash '<tag>:t:<scope>' and holds index '<tag>:th:<scope>', in ARGV's order)
-- ARGV[8]  (optional) model                   its price is read from the tenant's price table
-- ARGV[9]  (optional) input tokens            the call's worst case, 0..1e8 (uncached prompt)
-- ARGV[10]  (optional) output tokens           0..1e8 (its output reserve)
-- ARGV[11]  (optional) cached input tokens     0..1e8
-- ARGV[12]  (optional) n                       scopes, 1..3: the session's tenant, then scopes within it
-- ARGV[13..12+n]  (optional) scope names  the session's tenant, then scopes within it
--
-- KEYS count: 5; 7, 9 or 11 with one, two or three budget scopes (a hash and a holds index each)
-- Mode: mutating
-- Reply: status=ok|reservation=<id>|deadline_ms=<ms>|free=<tokens>|epoch=<n>|turn=<n>
--    or  status=refused|reason=<reason>|requested=<tokens>|free=<tokens>|epoch=<n>|turn=<n>
--   reason ceiling_reached (a scope's ceiling would be passed) adds |scope=<name>|quantity=
--   <input|output|cached_input|tokens|money>|ceiling=<n>; requested and free are then in
--   that quantity's unit (money: micro-cents); nothing is held anywhere
--   reason: token_budget_exhausted, floor_protected, or compaction_pending (retrieval and
--   recall while a compaction is pending, judged as admit.lua judges them: refused while
--   the last compaction failed to reach H (not a deferral), else H + pm + tokens +
--   output reserve <= window; a compaction_pending refusal adds
--   |bound=<pending|failed>|baseline=<tokens>; a request
--   within that bound but above the free room gets the free-room reason)
-- Errors: LEDGER_BADARG, LEDGER_NOSCOPE (a scope named has no ceilings set), LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED,
--         LEDGER_CONFLICT (the reservation id is open already, or the consumer holds an
--         item of that id: settle names the item after the reservation by default),
--         LEDGER_TURNHELD, LEDGER_TURNLOST (see `fence` in _common.lua).
-- Calls: HMGET, TIME, HSET, ZADD (HMGET of the op's outcome bucket and the epoch base e, HSET of the bucket; a PEXPIRE, or the outcome generations' RENAME and PEXPIRE, when due; HINCRBY on refusal).

local op, fp, epoch, tok = op_args('reserve', false)
local sid, c, rid, tokens, lease
sid = session_arg(ARGV[3])
c = consumer_arg(ARGV[4])
rid = id_arg(ARGV[5], 'reservation id')
tokens = int_arg(ARGV[6], 'tokens', 1, TOKENS_MAX)
lease = int_arg(ARGV[7], 'lease ms', 1, 86400000)
local names, suffixes, last, model, want = nil, {}, 7, nil, nil
if #ARGV > 7 then
  model = id_arg(ARGV[8], 'model')
  want = scope_tokens(9, '')
  names, suffixes, last = scope_args(12, sid)
end
if #ARGV ~= last then fail('BADARG', 'expected ' .. last .. ' arguments, got ' .. #ARGV) end
local A, F = ACTIVE[c], FLOOR[c]

scope_key_arg(2, 'deadlines', suffixes)
local S, price, T
if names and #names == 1 then T = scope_fast(lease, model) end
if names and not T then S, price = scope_config(names, 3, lease, model) end
local key = KEYS[1]
local H, R = load(key, { 'ep', 'tn', 'fr', A, F, 'v_' .. c, 'nv', 'gz', 'xp', 'cd',
  'r:' .. rid, 'i:' .. c .. ':' .. rid, 'lo', 'ul', 'uo' }, 10)
local again = gate(recorded(op), H.ep, op, fp, epoch)
if again then return again end
local in_turn = fence(key, R[3], H.tn, tok)
if R[1] then fail('CONFLICT', 'reservation ' .. rid .. ' is already open') end
if R[2] then
  fail('CONFLICT', consumer_name(c) .. ' already holds an item ' .. rid ..
    ': the reservation could not be settled under its own id')
end
local now = now_ms()

local a = H[A]
local d = claim_delta(a, tokens, H[F] or 0)
local J = { gz = H.gz, xp = H.xp, uo = in_turn and (R[5] or '') or nil }
-- (compaction credit: memory waits for the pending compaction)
local refused, pm = refuse_growth(key, A == 'a_rm' and H.cd == 1, tokens, d, H, tokens, now, op, fp, J)
if refused then return refused end
local deadline = now + lease
if T and not scope_fast_hold(T, now, sid .. '|' .. rid, deadline, want) then
  S, price = scope_config(names, 3, lease, model)  -- (a new bucket, a hold due, or a refusal)
end
if S then
  want['$'] = want.i * price[1] + want.o * price[2] + want.c * price[3]
  for _, sc in ipairs(S) do
    scope_sweep(sc, now)
    local q, cap, left, asked = scope_room(sc, now, want)
    if q then
      indicate(key, 'refused_ceiling', 1)
      redis.call('HINCRBY', sc.hk, 'nr', 1)
      return commit(key, now, op, fp, reply({ 'status=refused', 'reason=ceiling_reached',
        'requested=' .. num(asked), 'free=' .. num(math.max(left, 0)), 'epoch=' .. H.ep, 'turn=' .. H.tn,
        'scope=' .. sc.name, 'quantity=' .. q, 'ceiling=' .. num(cap) }), {}, J)
    end
  end
  scope_hold(S, now, sid .. '|' .. rid, deadline, want, price)
end
redis.call('ZADD', KEYS[2], deadline, sid .. '|' .. rid)
local args = { 'r:' .. rid, c .. '|' .. tokens .. '|' .. deadline, 'fr', H.fr - d, A, a + tokens,
  'v_' .. c, H['v_' .. c] + tokens, 'nv', H.nv + 1 }
if pm then args[#args + 1], args[#args + 2] = 'pm', pm + tokens end
if in_turn then args[#args + 1], args[#args + 2] = 'ul', journal(R[4], { 'r:' .. rid }, {}) end
return commit(key, now, op, fp, reply({ 'status=ok', 'reservation=' .. rid, 'deadline_ms=' .. deadline,
  'free=' .. (H.fr - d), 'epoch=' .. H.ep, 'turn=' .. H.tn }), args, J)
