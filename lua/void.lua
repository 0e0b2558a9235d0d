-- void.lua: cancel an open reservation and give its tokens back.
--
-- KEYS[1]  session hash
-- KEYS[2]  partition deadline index
-- KEYS[3]  partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[4]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[5]  previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch[@turn]             integer; older than the session's -> LEDGER_STALE; @turn:
--                                  a call of that turn (see `fence`)
-- ARGV[3]  session id              the member prefix in the deadline index
-- ARGV[4]  reservation id
-- (optional, a reservation charged to budget scopes, docs/ceilings.md; KEYS[3..] are then
-- each scope's hash and holds index; a hold already swept, its deadline passed, is skipped)
-- ARGV[5]  (optional) n                       scopes, 1..3, as the reservation named them
-- ARGV[6..5+n]  (optional) scope names  as the reservation named them
--
-- KEYS count: 5; 7, 9 or 11 with one, two or three budget scopes
-- Mode: mutating
-- Reply: status=ok|reservation=<id>|released=<tokens>|free=<tokens>|epoch=<n>|turn=<n>
-- Errors: LEDGER_BADARG, LEDGER_NOSCOPE, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED, LEDGER_NORESERVATION,
--         LEDGER_TURNHELD, LEDGER_TURNLOST (see `fence` in _common.lua).
-- Calls: HMGET, TIME, HSET, HDEL, ZREM (HSCAN of the reservation's children when it has any; HMGET of the op's outcome bucket and the epoch base e, HSET of the bucket; a PEXPIRE, or the outcome generations' RENAME and PEXPIRE, when due).

local op, fp, epoch, tok = op_args('void', false)
local sid, rid, S
if #ARGV > 4 then
  sid = session_arg(ARGV[3])
  rid = id_arg(ARGV[4], 'reservation id')
  local names, suffixes, last = scope_args(5, sid)
  if #ARGV ~= last then fail('BADARG', 'expected ' .. last .. ' arguments, got ' .. #ARGV) end
  scope_key_arg(2, 'deadlines', suffixes)
  S = scope_config(names, 3)
else
  sid, rid = sid_and_id('reservation id')
end
local key = KEYS[1]
local res, again = open_reservation(key, op, fp, epoch, rid, tok)
if again then return again end
if S then scope_holds(S, sid .. '|' .. rid, res.deadline < now_ms()) end
local c, est = res.c, res.est
local A, F = ACTIVE[c], FLOOR[c]
local H, R = load(key, { 'ep', 'tn', 'fr', A, F, 'v_' .. c, 'nv', 'gz', 'xp' }, 9)
local now = now_ms()
local a = H[A]
local fr = H.fr - claim_delta(a, -est, H[F] or 0)
-- (the reservation goes, and its children with it: their pool and each child's field)
local gone, was = child_fields(key, rid, res.pool)
table.insert(gone, 1, 'r:' .. rid)
table.insert(was, 1, res.rec)
call_each('HDEL', key, gone)
redis.call('ZREM', KEYS[2], sid .. '|' .. rid)
if S then scope_close(S, sid .. '|' .. rid, nil) end
local args = { 'fr', fr, A, a - est, 'v_' .. c, H['v_' .. c] - est, 'nv', H.nv - 1 }
if res.in_turn then args[#args + 1], args[#args + 2] = 'ul', journal(res.ul, gone, was) end
return commit(key, now, op, fp, reply({ 'status=ok', 'reservation=' .. rid, 'released=' .. est,
  'free=' .. fr, 'epoch=' .. H.ep, 'turn=' .. H.tn }), args, { gz = H.gz, xp = H.xp, uo = res.uo })
