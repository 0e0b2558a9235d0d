-- renew_turn.lua: extend the open turn's lease (docs/agent.md#turn-leases).
--
-- The owner renews while the turn runs (a long model call, a slow tool), so that no
-- other process takes the turn for dead. The lease then ends `lease` ms from now on
-- Redis's clock. A lapsed lease can be renewed while nobody has rolled the turn back.
--
-- KEYS[1]  session hash
-- KEYS[2]  partition deadline index  the turn lease's member '<session>|~' (score: its end)
-- KEYS[3]  partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[4]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[5]  previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  v:epoch@turn!token     the version, the epoch, the open turn and its owner token
-- ARGV[3]  session id              must name KEYS[1]
-- ARGV[4]  lease                   milliseconds from now, 1..86400000
--
-- Mode: mutating
-- Reply: status=ok|turn=<n>|lease=<ms>|epoch=<n>
-- Errors: LEDGER_BADARG (also: no turn named), LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED,
--         LEDGER_TURNLOST (the turn is not open: ended, rolled back or followed by another).
-- Calls: HMGET, TIME, HSET, ZADD (HMGET of the op's outcome bucket and the epoch base e, HSET
--        of the bucket; a PEXPIRE, or the outcome generations' RENAME and PEXPIRE, when due).

local op, fp, epoch, tok = op_args('renew_turn', false)
local sid, lease
sid = session_arg(ARGV[3])
lease = int_arg(ARGV[4], 'lease ms', 1, 86400000)
if not tok then fail('BADARG', 'renew_turn needs the turn: send <epoch>@<turn>') end
if #ARGV ~= 4 then fail('BADARG', 'expected 4 arguments, got ' .. #ARGV) end

key_arg(2, 'deadlines')
local key = KEYS[1]
local H, R = load(key, { 'ep', 'tn', 'gz', 'xp', 'lo', 'uo' }, 4)
local again = gate(recorded(op), H.ep, op, fp, epoch)
if again then return again end
fence(key, R[1], H.tn, tok)
local now = now_ms()
local le = now + lease
redis.call('ZADD', KEYS[2], le, sid .. '|' .. LEASE)
return commit(key, now, op, fp, reply({ 'status=ok', 'turn=' .. H.tn, 'lease=' .. le,
  'epoch=' .. H.ep }), { 'le', le }, { gz = H.gz, xp = H.xp, uo = R[2] or '' })
