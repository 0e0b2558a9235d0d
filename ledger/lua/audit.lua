-- audit.lua: prove a session's counters equal the sum of its items (read-only).
--
-- KEYS[1]  session hash
-- ARGV[1]  protocol version         the call's (docs/protocol.md#versions); another one
--                                  is LEDGER_VERSION
--
-- Reply: status=clean|overdue=<id,...>|now=<ms>
--    or  status=violations|problems=<text;text;...>|overdue=<id,...>|now=<ms>
--   Checks: per consumer, tokens and counts of items equal u_<c> and n_<c>; open
--   reservations equal v_<c> and nv; group actives equal items plus reservations;
--   fr equals the window minus every claim and is not negative (no over-allocation).
--   The last end_turn's drift, when flagged (df = 1: the real prompt differed from
--   occupancy beyond the framing tolerance, or was larger than the window) and not
--   reconciled since, is a problem too: the counters no longer describe the prompt.
--   overdue lists open reservations whose deadline has passed; the caller judges
--   them against its sweep interval.
-- Errors: LEDGER_NOSESSION, LEDGER_VERSION (another protocol, or a session of a layout
--         these scripts do not read).
-- Calls: HGETALL, TIME.

protocol_arg(ARGV[1])
if #ARGV ~= 1 then fail('BADARG', 'expected 1 argument, got ' .. #ARGV) end
local all = redis.call('HGETALL', KEYS[1])
local f = {}
for i = 1, #all, 2 do f[all[i]] = all[i + 1] end
if not f.ep then fail('NOSESSION', NOSESSION) end
layout_check(f.lv)
local now = now_ms()
local u, n, v = { w = 0, r = 0, m = 0, s = 0 }, { w = 0, r = 0, m = 0, s = 0 }, { w = 0, r = 0, m = 0, s = 0 }
local nv, overdue = 0, {}
for name, val in pairs(f) do
  local c = string.match(name, '^i:(%a):')
  if c then
    u[c] = u[c] + tonumber(string.match(val, '^(%d+)|'))
    n[c] = n[c] + 1
  end
  local rid = string.match(name, '^r:(.+)$')
  if rid then
    local rc, est, deadline = string.match(val, '^(%a)|(%d+)|(%d+)$')
    v[rc] = v[rc] + tonumber(est)
    nv = nv + 1
    if tonumber(deadline) < now then overdue[#overdue + 1] = rid end
  end
end
local problems = {}
-- A stored total (have) against the one its items or reservations add up to (want).
local function check(name, have, want, by)
  if tonumber(have) ~= want then
    problems[#problems + 1] = name .. ' is ' .. tostring(have) .. ', ' .. (by or 'items') .. ' say ' .. want
  end
end
for _, c in ipairs({ 'w', 'r', 'm', 's' }) do
  local name = consumer_name(c)
  check(name .. ' used', f['u_' .. c], u[c])
  check(name .. ' item count', f['n_' .. c], n[c])
  check(name .. ' reserved', f['v_' .. c], v[c], 'reservations')
end
check('open reservations', f.nv, nv, 'reservations')
check('working_memory active', f.a_w, u.w + v.w, 'items and reservations')
check('memory (retrieval + recall) active', f.a_rm, u.r + v.r + u.m + v.m, 'items and reservations')
check('scratchpad active', f.a_s, u.s + v.s, 'items and reservations')
local N = function(x) return tonumber(f[x]) end
local B = { W = N('W'), S = N('S'), T = N('T'), F_w = N('F_w'), F_rm = N('F_rm') }
local free = free_room(B, N('out'), u.w + v.w, u.r + v.r + u.m + v.m, u.s + v.s)
check('free', f.fr, free, 'items and reservations')
if free < 0 then problems[#problems + 1] = 'over-allocated by ' .. (-free) .. ' tokens' end
if f.df == '1' then
  problems[#problems + 1] = 'drift: the last prompt (' .. f.dp .. ' tokens) differs from occupancy by ' ..
    f.dr .. ' tokens (tolerance ' .. f.dt .. ', window ' .. f.W .. '), reconcile the ledger to the prompt'
end
local tail = { 'overdue=' .. table.concat(overdue, ','), 'now=' .. now }
if #problems == 0 then return reply({ 'status=clean', tail[1], tail[2] }) end
return reply({ 'status=violations', 'problems=' .. table.concat(problems, ';'), tail[1], tail[2] })
