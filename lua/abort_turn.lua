-- abort_turn.lua: roll back the caller's open turn (docs/agent.md#a-dead-turn-is-undone).
--
-- The turn's owner gives it up (its model call failed, it cannot finish): every item the
-- turn added goes, what it released, reclaimed, evicted or compacted away comes back, its
-- reservations are undone, the deliveries it was handed are queued again for the next
-- turn, and its lease ends. A turn that is no longer open (ended, rolled back, or
-- followed by another) is left alone: rolled_back=0. A hard reset staged while a turn was
-- open (see reset.lua) applies after the call's commit when no turn is open any more:
-- reset=<the new epoch> (empty: none applied).
--
-- KEYS[1]  session hash
-- KEYS[2]  partition deadline index  the turn lease's member '<session>|~'
-- KEYS[3]  content store           '<tag>:content:<session>' (deleted by a staged reset)
-- KEYS[4]  summaries               '<tag>:compacted:<session>' (deleted by a staged reset)
-- KEYS[5]  partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[6]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[7]  previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  v:epoch@turn!token     the version, the epoch, the turn to roll back and its owner
--                                  token
-- ARGV[3]  session id              must name KEYS[1]
--
-- Mode: mutating
-- Reply: status=ok|rolled_back=<turn or 0>|turn=<n>|free=<tokens>|epoch=<n>|reset=<new epoch, or empty>
-- Errors: LEDGER_BADARG (also: no turn named), LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED.
-- Calls: HMGET, TIME, HGETALL, HDEL, HSET, ZREM, ZADD, HINCRBY (HMGET of the op's outcome
--        bucket and the epoch base e, HSET of the bucket; a PEXPIRE, or the outcome
--        generations' RENAME and PEXPIRE, when due); HEXISTS, and with a staged reset HGETALL,
--        HDEL, ZREM, HINCRBY, DEL and HSET (see `reset_effect`).

local op, fp, epoch, tok = op_args('abort_turn', false)
local sid
sid = session_arg(ARGV[3])
if type(tok) ~= 'number' then
  fail('BADARG', 'abort_turn needs the turn to roll back: send <epoch>@<turn>')
end
if #ARGV ~= 3 then fail('BADARG', 'expected 3 arguments, got ' .. #ARGV) end

key_arg(2, 'deadlines', 'content:%s', 'compacted:%s')
local key = KEYS[1]
local H, R = load(key, { 'ep', 'tn', 'gz', 'xp', 'lo', 'rz' }, 4)
local again = gate(recorded(op), H.ep, op, fp, epoch)
if again then return again end
local now = now_ms()
local rolled = 0
if R[1] and H.tn == tok then
  -- (only the handle that began the turn rolls it back by name: it carries the owner token)
  if not owns(redis.call('HGET', key, 'lk')) then turn_held(key, R[1], H.tn, NOT_OWNER) end
  rolled = rollback(key, KEYS[2], sid, 'aborted by ' .. R[1])
end
local fr = redis.call('HGET', key, 'fr')
local st = reset_staged(R[2], H.ep)
if st and R[1] and rolled == 0 then st = nil end  -- (another turn stays open: it waits for that one)
local out = commit(key, now, op, fp, reply({ 'status=ok', 'rolled_back=' .. rolled, 'turn=' .. H.tn,
  'free=' .. fr, 'epoch=' .. H.ep, 'reset=' .. (st and (H.ep + 1) or '') }), {}, { gz = H.gz, xp = H.xp })
reset_at_end(key, st, { KEYS[2], KEYS[3], KEYS[4] }, sid)
return out
