-- audit.lua: prove a session's counters equal the sum of its items (read-only).
--
-- KEYS[1]  session hash
-- ARGV[1]  protocol version         the call's (docs/protocol.md#versions); another one
--                                  is LEDGER_VERSION
--
-- Mode: read-only
-- Reply: status=clean|overdue=<id,...>|now=<ms>
--    or  status=violations|problems=<text;text;...>|overdue=<id,...>|now=<ms>
--   Checks: per consumer, tokens and counts of items equal u_<c> and n_<c>; open
--   reservations equal v_<c> and nv; group actives equal items plus reservations;
--   fr equals the window minus every claim and is not negative (no over-allocation).
--   The last end_turn's drift, when flagged (df = 1: the real prompt differed from
--   occupancy beyond the framing tolerance, or was larger than the window) and not
--   reconciled since, is a problem too: the counters no longer describe the prompt.
--   So is an orphan: a child's field 'k:<id>|<child>' or a pool 'k:<id>' whose
--   reservation <id> is not open (a closed reservation's children go with it).
--   overdue lists open reservations whose deadline has passed; the caller judges
--   them against its sweep interval.
--    or  status=damaged|problems=<text;text;...>|overdue=|now=<ms>
--   A session whose hash cannot be read as the scripts write it (a counter missing or
--   not a whole number, an item or a reservation whose value or consumer is not of
--   the layout) is not judged: each problem names the field and what it holds, and no
--   other check runs on it. Never a Lua error: a fleet-wide audit gives every other
--   session its verdict.
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
-- What a damaged hash holds, shown in a problem: short, and without the reply's
-- separators ('|' between fields, ';' between problems).
local function shown(x)
  return (string.gsub(string.sub(x, 1, 40), '[|;]', '?'))
end
local damaged = {}
local function damage(field, what)
  damaged[#damaged + 1] = "damaged: field '" .. shown(field) .. "' " .. what
end
-- A stored whole number (a counter or a budget field), or nil with the damage noted.
local function whole(name)
  local x = f[name]
  if x == nil then
    damage(name, 'is missing')
  elseif not string.match(x, '^-?%d+$') then
    damage(name, "holds '" .. shown(x) .. "', not a whole number")
  else
    return tonumber(x)
  end
  return nil
end
local KNOWN = { w = true, r = true, m = true, s = true }
local u, n, v = { w = 0, r = 0, m = 0, s = 0 }, { w = 0, r = 0, m = 0, s = 0 }, { w = 0, r = 0, m = 0, s = 0 }
local nv, overdue, orphans = 0, {}, {}
for name, val in pairs(f) do
  -- a child's field or a pool 'k:<id>' whose reservation <id> is not open: an orphan
  local kid = string.match(name, '^k:([^|]+)')
  if kid and not f['r:' .. kid] then orphans[kid] = (orphans[kid] or 0) + 1 end
  if string.sub(name, 1, 2) == 'i:' then
    local c = string.match(name, '^i:(%a):.')
    local tokens = string.match(val, '^(%d+)|%-?%d+|%-?%d+|%d+$')
    if not (c and KNOWN[c]) then
      damage(name, 'names no consumer (w, r, m or s)')
    elseif not tokens then
      damage(name, "holds '" .. shown(val) .. "', not 4 numbers (tokens, turn, priority, seq)")
    else
      u[c] = u[c] + tonumber(tokens)
      n[c] = n[c] + 1
    end
  end
  local rid = string.match(name, '^r:(.+)$')
  if rid then
    local rc, est, deadline = string.match(val, '^(%a)|(%d+)|(%d+)$')
    if not (rc and KNOWN[rc]) then
      damage(name, "holds '" .. shown(val) .. "', not a consumer, tokens and a deadline")
    else
      v[rc] = v[rc] + tonumber(est)
      nv = nv + 1
      if tonumber(deadline) < now then overdue[#overdue + 1] = rid end
    end
  end
end
local stored = {}
for _, name in ipairs({ 'W', 'S', 'T', 'out', 'F_w', 'F_rm', 'fr', 'nv', 'a_w', 'a_rm', 'a_s',
  'u_w', 'u_r', 'u_m', 'u_s', 'n_w', 'n_r', 'n_m', 'n_s', 'v_w', 'v_r', 'v_m', 'v_s' }) do
  stored[name] = whole(name)
end
if f.df == '1' then
  for _, name in ipairs({ 'dp', 'dr', 'dt' }) do stored[name] = whole(name) end
end
if #damaged > 0 then
  return reply({ 'status=damaged', 'problems=' .. table.concat(damaged, ';'), 'overdue=', 'now=' .. now })
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
local B = { W = stored.W, S = stored.S, T = stored.T, F_w = stored.F_w, F_rm = stored.F_rm }
local free = free_room(B, stored.out, u.w + v.w, u.r + v.r + u.m + v.m, u.s + v.s)
check('free', f.fr, free, 'items and reservations')
if free < 0 then problems[#problems + 1] = 'over-allocated by ' .. (-free) .. ' tokens' end
local closed = {}
for kid in pairs(orphans) do closed[#closed + 1] = kid end
table.sort(closed)  -- (the same problems in the same order, whatever the hash's order)
for _, kid in ipairs(closed) do
  problems[#problems + 1] = 'orphan: ' .. orphans[kid] .. ' child field(s) k:' .. shown(kid) ..
    '* of reservation ' .. shown(kid) .. ', which is not open'
end
if f.df == '1' then
  problems[#problems + 1] = 'drift: the last prompt (' .. f.dp .. ' tokens) differs from occupancy by ' ..
    f.dr .. ' tokens (tolerance ' .. f.dt .. ', window ' .. f.W .. '), reconcile the ledger to the prompt'
end
local tail = { 'overdue=' .. table.concat(overdue, ','), 'now=' .. now }
if #problems == 0 then return reply({ 'status=clean', tail[1], tail[2] }) end
return reply({ 'status=violations', 'problems=' .. table.concat(problems, ';'), tail[1], tail[2] })
