-- draw_child.lua: a child draws tokens from its parent's reservation: within its floor
-- always, past it while the pool has room no other child's floor holds
-- (docs/ceilings.md#parent-and-child-sessions).
--
-- KEYS[1]  session hash            the parent session
-- KEYS[2]  partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[3]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[4]  previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch[@turn]             integer; older than the session's -> LEDGER_STALE; @turn:
--                                  a call of that turn (see `fence`)
-- ARGV[3]  session id              the parent's
-- ARGV[4]  reservation id          the pool
-- ARGV[5]  child id                an open child of it
-- ARGV[6]  tokens                  1..1e8
--
-- Mode: mutating
-- Reply: status=ok|reservation=<id>|child=<id>|used=<tokens>|floor=<tokens>|free=<tokens>|epoch=<n>|turn=<n>
--    or  status=refused|reason=token_budget_exhausted|requested=<tokens>|free=<tokens>|epoch=<n>|turn=<n>
--   free: what this child may still draw (the rest of its floor and the pool's room).
-- Errors: LEDGER_BADARG, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED, LEDGER_NORESERVATION
--         (the reservation or the child is not open), LEDGER_TURNHELD, LEDGER_TURNLOST.
-- Calls: HMGET, TIME, HSET (HMGET of the op's outcome bucket and the epoch base e, HSET of the bucket; a PEXPIRE, or the outcome generations' RENAME and PEXPIRE, when due; HINCRBY on refusal).

local op, fp, epoch, tok = op_args('draw_child', false)
session_arg(ARGV[3])
local rid = id_arg(ARGV[4], 'reservation id')
local child = id_arg(ARGV[5], 'child id')
local tokens = int_arg(ARGV[6], 'tokens', 1, TOKENS_MAX)
if #ARGV ~= 6 then fail('BADARG', 'expected 6 arguments, got ' .. #ARGV) end
key_arg(2)
local key = KEYS[1]
local res, again = open_reservation(key, op, fp, epoch, rid, tok)
if again then return again end
local H, R = load(key, { 'ep', 'tn', 'gz', 'xp', 'k:' .. rid, 'k:' .. rid .. '|' .. child }, 4)
if not R[2] then fail('NORESERVATION', 'child ' .. child .. ' is not open on reservation ' .. rid) end
local floors, beyond, n = string.match(R[1], '^(%d+)|(%d+)|(%d+)$')
floors, beyond = tonumber(floors), tonumber(beyond)
local f, used = string.match(R[2], '^(%d+)|(%d+)$')
f, used = tonumber(f), tonumber(used)
local now = now_ms()
local J = { gz = H.gz, xp = H.xp, uo = res.uo }
local room = res.est - floors - beyond
local extra = math.max(used + tokens, f) - math.max(used, f)
if extra > room then
  indicate(key, 'refused', 1)
  return commit(key, now, op, fp, reply({ 'status=refused', 'reason=token_budget_exhausted',
    'requested=' .. tokens, 'free=' .. (math.max(f - used, 0) + room), 'epoch=' .. H.ep, 'turn=' .. H.tn }), {}, J)
end
used = used + tokens
local args = { 'k:' .. rid, floors .. '|' .. (beyond + extra) .. '|' .. n, 'k:' .. rid .. '|' .. child,
  f .. '|' .. used }
-- (in a turn, the records as they were go into its undo log: a rollback takes the draw back)
if res.in_turn then args[5], args[6] = 'ul', journal(res.ul, { args[1], args[3] }, { R[1], R[2] }) end
return commit(key, now, op, fp, reply({ 'status=ok', 'reservation=' .. rid, 'child=' .. child,
  'used=' .. used, 'floor=' .. f, 'free=' .. (math.max(f - used, 0) + room - extra), 'epoch=' .. H.ep,
  'turn=' .. H.tn }), args, J)
