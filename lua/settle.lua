-- settle.lua: turn an open reservation into an item of its actual size (phase two).
--
-- KEYS[1]  session hash
-- KEYS[2]  partition deadline index
-- KEYS[3]  (optional) reclaim-order index  '<tag>:order:<session>': kept when sent (see
--          ORDER in _common.lua)
-- KEYS[-3] partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[-2] outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[-1] previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch[@turn]             integer; older than the session's -> LEDGER_STALE; @turn:
--                                  a call of that turn (see `fence`)
-- ARGV[3]  session id              the member prefix in the deadline index
-- ARGV[4]  reservation id
-- ARGV[5]  actual tokens           1..1e8, lower or higher than the estimate
-- ARGV[6]  item id                 the item the settled tokens become
-- ARGV[7]  priority                0..1000
-- (optional, a reservation charged to budget scopes, docs/ceilings.md; its scopes' keys
-- then follow KEYS[2] (and the order index), hash and holds index per scope)
-- ARGV[8]  (optional) billed input tokens     0..1e8, what the provider billed (more or less than held)
-- ARGV[9]  (optional) billed output tokens    0..1e8
-- ARGV[10]  (optional) billed cached input     0..1e8
-- ARGV[11]  (optional) n                       scopes, 1..3, as the reservation named them
-- ARGV[12..11+n]  (optional) scope names  as the reservation named them
--
-- KEYS count: 5; 6 with the order index; two more a budget scope, with one, two or three: 7, 8, 9, 10, 11 or 12
-- Mode: mutating
-- Reply: status=ok|reservation=<id>|item=<id>|charged=<tokens>|free=<tokens>|epoch=<n>|turn=<n>
--        with scopes also |billed_money=<micro-cents>|over=<tokens>|over_money=<micro-cents>
--        (billed past the hold: charged all the same, and counted in each scope's ot and om)
--    or  status=refused|reason=<reason>|requested=<tokens>|free=<tokens>|epoch=<n>|turn=<n>
--        (the actual size does not fit; the reservation stays open until voided or expired;
--        reason token_budget_exhausted, floor_protected, or compaction_pending for memory
--        growing past its reservation while a compaction is pending, judged as admit.lua
--        judges it, with |bound=<pending|failed>|baseline=<tokens>)
-- Errors: LEDGER_BADARG, LEDGER_NOSCOPE, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED,
--         LEDGER_NORESERVATION (not open: settled, voided, expired and swept, or never made),
--         LEDGER_EXPIRED (its deadline has passed on Redis's clock),
--         LEDGER_CONFLICT (the consumer already holds the item id), LEDGER_TURNHELD,
--         LEDGER_TURNLOST (see `fence` in _common.lua).
-- Calls: HMGET, TIME, HSET, HDEL, ZREM (HSCAN of the reservation's children when it has any; ZADD of the reclaim-order index when sent, HGET of ttl and its PEXPIRE when due; HMGET of the op's outcome bucket and the epoch base e, HSET of the bucket; a PEXPIRE, or the outcome generations' RENAME and PEXPIRE, when due; HINCRBY and
--        HMGET of HW, out, W, kf, pm, kr on refusal or while a compaction is pending).

local op, fp, epoch, tok = op_args('settle', false)
local sid, rid, actual, item, prio
sid = session_arg(ARGV[3])
rid = id_arg(ARGV[4], 'reservation id')
actual = int_arg(ARGV[5], 'actual tokens', 1, TOKENS_MAX)
item = id_arg(ARGV[6], 'item id')
prio = int_arg(ARGV[7], 'priority', 0, 1000)
local names, suffixes, last, billed = nil, {}, 7, nil
if #ARGV > 7 then
  billed = scope_tokens(8, 'billed ')
  names, suffixes, last = scope_args(11, sid)
end
if #ARGV ~= last then fail('BADARG', 'expected ' .. last .. ' arguments, got ' .. #ARGV) end

local ORD = is_key(3, 'order:%s') and KEYS[3] or nil
if ORD then key_arg(2, 'deadlines', 'order:%s', unpack(suffixes)) else scope_key_arg(2, 'deadlines', suffixes) end
local S = names and scope_config(names, ORD and 4 or 3)
local key = KEYS[1]
local res, again = open_reservation(key, op, fp, epoch, rid, tok)
if again then return again end
local c, est, deadline = res.c, res.est, res.deadline
local A, F = ACTIVE[c], FLOOR[c]
local H, R = load(key, { 'ep', 'tn', 'sq', 'fr', A, F, 'u_' .. c, 'n_' .. c, 'v_' .. c,
  'nv', 'gz', 'xp', 'cd', 'oq', 'ox', 'i:' .. c .. ':' .. item }, 15)
local now = now_ms()
if now > deadline then
  fail('EXPIRED', 'reservation ' .. rid .. ' expired at ' .. deadline .. ' ms, ' .. (now - deadline) .. ' ms ago')
end
if R[1] then fail('CONFLICT', consumer_name(c) .. ' already holds item ' .. item) end
if S then scope_holds(S, sid .. '|' .. rid, false) end

local a = H[A]
local d = claim_delta(a, actual - est, H[F] or 0)
local J = { gz = H.gz, xp = H.xp, uo = res.uo }
-- (compaction credit, as admit.lua judges memory, for memory growing past its reservation)
local refused, pm = refuse_growth(key, A == 'a_rm' and H.cd == 1 and actual > est, actual - est, d, H, actual,
  now, op, fp, J)
if refused then return refused end
-- (the reservation goes, and its children with it: their pool and each child's field)
local gone, was = child_fields(key, rid, res.pool)
table.insert(gone, 1, 'r:' .. rid)
table.insert(was, 1, res.rec)
call_each('HDEL', key, gone)
redis.call('ZREM', KEYS[2], sid .. '|' .. rid)
local fr = H.fr - d
local scoped = {}
if S then
  local over, over_m, cost = scope_close(S, sid .. '|' .. rid, billed)
  scoped = { 'billed_money=' .. num(cost), 'over=' .. over, 'over_money=' .. num(over_m) }
end
local args = { 'i:' .. c .. ':' .. item, actual .. '|' .. H.tn .. '|' .. prio .. '|' .. (H.sq + 1),
  'sq', H.sq + 1, 'fr', fr, A, a - est + actual, 'u_' .. c, H['u_' .. c] + actual,
  'n_' .. c, H['n_' .. c] + 1, 'v_' .. c, H['v_' .. c] - est, 'nv', H.nv - 1 }
if pm then args[#args + 1], args[#args + 2] = 'pm', pm + actual - est end
if res.in_turn then args[#args + 1], args[#args + 2] = 'ul', journal(res.ul, gone, was) end
order_keep(ORD, c, H.oq, H.sq, H.sq + 1, ORDER[c] and { order_score(c, H.sq + 1), args[1] },
  H.ox, now, key, args)
return commit(key, now, op, fp, reply({ 'status=ok', 'reservation=' .. rid, 'item=' .. item,
  'charged=' .. actual, 'free=' .. fr, 'epoch=' .. H.ep, 'turn=' .. H.tn, unpack(scoped) }), args, J)
