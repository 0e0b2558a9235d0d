-- expire.lua: release a session's reservations whose deadline has passed, and roll back
-- its open turn when the turn's lease has lapsed (docs/agent.md#a-dead-turn-is-undone).
--
-- The sweeper reads due members from the partition deadline index and calls this
-- once per session; the deadline is checked again here against Redis's clock. The id
-- '~' stands for the turn lease (its member '<session>|~' in the index).
--
-- KEYS[1]  session hash
-- KEYS[2]  partition deadline index
-- KEYS[3]  partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[4]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[5]  previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch or '*'            the sweeper sends '*': expiry is not fenced
-- ARGV[3]  session id
-- ARGV[4]  n                       number of reservation ids, 1..1000
-- ARGV[5..4+n]  reservation ids  each an open reservation's id, or '~' for the turn lease
--
-- Mode: mutating
-- Reply: status=ok|expired=<n>|released=<tokens>|pending=<id,...>|rolled_back=<turn or 0>
--   pending: ids whose deadline has not passed (left open). Ids that are no longer
--   open are dropped from the index. A missing session only cleans the index. A turn
--   rolled back is done first: its reservations are then judged as the rollback left them.
-- Errors: LEDGER_BADARG, LEDGER_STALE, LEDGER_OPREUSED.
-- Calls: HMGET, TIME, HSET, HDEL, ZREM (HGETALL, ZADD and HINCRBY to roll a turn back; HSCAN of
--        an expired reservation's children when it has any) (HMGET of the op's outcome bucket and the epoch base e, HSET of the bucket; a PEXPIRE, or the outcome generations' RENAME and PEXPIRE, when due).

local op, fp, epoch = op_args('expire', true)
local sid, n
sid = session_arg(ARGV[3])
n = int_arg(ARGV[4], 'reservation count', 1, 1000)
if #ARGV ~= 4 + n then
  fail('BADARG', 'expected ' .. (4 + n) .. ' arguments for ' .. n .. ' reservation ids, got ' .. #ARGV)
end
local raws = { 'ep', 'fr', 'a_w', 'a_rm', 'a_s', 'F_w', 'F_rm', 'v_w', 'v_r', 'v_m', 'v_s', 'nv', 'gz', 'xp',
  'le', 'lo' }
local lease = false
for k = 1, n do
  local rid = ARGV[4 + k]
  if rid == LEASE then
    if lease then fail('BADARG', 'the turn lease ~ appears twice') end
    lease = true
  else
    rid = id_arg(rid, 'reservation id')
  end
  raws[k + 16] = 'r:' .. rid
  raws[n + k + 16] = 'k:' .. rid  -- (its children's pool; '~' has none)
end

key_arg(2, 'deadlines')
local key = KEYS[1]
local H, R = load(key, raws, 15)
local again = replay(recorded(op), op, fp)
if again then return again end
local now = now_ms()
local gone, pending, dead, released, expired, rolled = {}, {}, {}, 0, 0, 0
if not H.ep then
  for k = 1, n do gone[#gone + 1] = sid .. '|' .. ARGV[4 + k] end
  redis.call('ZREM', KEYS[2], unpack(gone))
  return reply({ 'status=ok', 'expired=0', 'released=0', 'pending=', 'rolled_back=0' })
end
layout_check(redis.call('HGET', key, 'lv'))
stale(H.ep, epoch)
if lease and R[1] and H.le < now then
  rolled = rollback(key, KEYS[2], sid, 'lease of ' .. R[1] .. ' lapsed')
  H, R = load(key, raws, 15)
end
for k = 1, n do
  local rec = R[k + 1]
  if ARGV[4 + k] == LEASE then
    if not R[1] then
      gone[#gone + 1] = sid .. '|' .. LEASE
    elseif rolled == 0 then
      pending[#pending + 1] = LEASE
    end
  elseif not rec then
    gone[#gone + 1] = sid .. '|' .. ARGV[4 + k]
  else
    local c, est, deadline = string.match(rec, '^(%a)|(%d+)|(%d+)$')
    if tonumber(deadline) < now then
      est = tonumber(est)
      local A = ACTIVE[c]
      H.fr = H.fr - claim_delta(H[A], -est, H[FLOOR[c]] or 0)
      H[A] = H[A] - est
      H['v_' .. c] = H['v_' .. c] - est
      H.nv = H.nv - 1
      released, expired = released + est, expired + 1
      dead[#dead + 1] = raws[k + 16]
      -- (its children go with it: their pool and each child's field)
      for _, f in ipairs((child_fields(key, ARGV[4 + k], R[n + k + 1]))) do dead[#dead + 1] = f end
      gone[#gone + 1] = sid .. '|' .. ARGV[4 + k]
    else
      pending[#pending + 1] = ARGV[4 + k]
    end
  end
end
if #gone > 0 then redis.call('ZREM', KEYS[2], unpack(gone)) end
local args = {}
if expired > 0 then
  call_each('HDEL', key, dead)
  indicate(key, 'expired', expired)
  args = { 'fr', H.fr, 'a_w', H.a_w, 'a_rm', H.a_rm, 'a_s', H.a_s, 'v_w', H.v_w, 'v_r', H.v_r,
    'v_m', H.v_m, 'v_s', H.v_s, 'nv', H.nv }
end
return commit(key, now, op, fp, reply({ 'status=ok', 'expired=' .. expired, 'released=' .. released,
  'pending=' .. table.concat(pending, ','), 'rolled_back=' .. rolled }), args, { gz = H.gz, xp = H.xp })
