-- open_child.lua: open a child (a subagent) that draws from an open reservation of its
-- parent session, with a floor held for it alone (docs/ceilings.md#parent-and-child-sessions).
--
-- The reservation is the children's pool: their floors, and what they drew past their
-- floors, never pass its tokens. A child whose floor does not fit what is left is refused
-- alone: the children already open keep their floors.
--
-- KEYS[1]  session hash            the parent session
-- KEYS[2]  partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[3]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[4]  previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch[@turn]             integer; older than the session's -> LEDGER_STALE; @turn:
--                                  a call of that turn (see `fence`)
-- ARGV[3]  session id              the parent's
-- ARGV[4]  reservation id          the parent's open reservation: the pool
-- ARGV[5]  child id                [A-Za-z0-9._:/@+=#-]{1,128}, new on this reservation
-- ARGV[6]  floor                   tokens held for the child, 0..1e8
--
-- Mode: mutating
-- Reply: status=ok|reservation=<id>|child=<id>|floor=<tokens>|free=<tokens>|epoch=<n>|turn=<n>
--    or  status=refused|reason=child_floor|requested=<floor>|free=<tokens>|epoch=<n>|turn=<n>
--   free: what the pool has left past every floor and every draw past a floor.
-- Errors: LEDGER_BADARG, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED, LEDGER_NORESERVATION,
--         LEDGER_CONFLICT (the child is open already), LEDGER_TURNHELD, LEDGER_TURNLOST.
-- Calls: HMGET, TIME, HSET (HMGET of the op's outcome bucket and the epoch base e, HSET of the bucket; a PEXPIRE, or the outcome generations' RENAME and PEXPIRE, when due; HINCRBY on refusal).

local op, fp, epoch, tok = op_args('open_child', false)
session_arg(ARGV[3])
local rid = id_arg(ARGV[4], 'reservation id')
local child = id_arg(ARGV[5], 'child id')
local floor = int_arg(ARGV[6], 'floor', 0, TOKENS_MAX)
if #ARGV ~= 6 then fail('BADARG', 'expected 6 arguments, got ' .. #ARGV) end
key_arg(2)
local key = KEYS[1]
local res, again = open_reservation(key, op, fp, epoch, rid, tok)
if again then return again end
local H, R = load(key, { 'ep', 'tn', 'gz', 'xp', 'k:' .. rid, 'k:' .. rid .. '|' .. child }, 4)
if R[2] then fail('CONFLICT', 'child ' .. child .. ' is already open on reservation ' .. rid) end
local floors, beyond, n = string.match(R[1] or '0|0|0', '^(%d+)|(%d+)|(%d+)$')
floors, beyond, n = tonumber(floors), tonumber(beyond), tonumber(n)
local now = now_ms()
local J = { gz = H.gz, xp = H.xp, uo = res.uo }
local left = res.est - floors - beyond
if floor > left then
  indicate(key, 'refused_child', 1)
  return commit(key, now, op, fp, reply({ 'status=refused', 'reason=child_floor', 'requested=' .. floor,
    'free=' .. left, 'epoch=' .. H.ep, 'turn=' .. H.tn }), {}, J)
end
local args = { 'k:' .. rid, (floors + floor) .. '|' .. beyond .. '|' .. (n + 1), 'k:' .. rid .. '|' .. child,
  floor .. '|0' }
-- (in a turn, the records as they were go into its undo log: a rollback closes the child)
if res.in_turn then args[5], args[6] = 'ul', journal(res.ul, { args[1], args[3] }, { R[1], R[2] }) end
return commit(key, now, op, fp, reply({ 'status=ok', 'reservation=' .. rid, 'child=' .. child,
  'floor=' .. floor, 'free=' .. (left - floor), 'epoch=' .. H.ep, 'turn=' .. H.tn }), args, J)
