-- record_span.lua: account one memory-tool span of the current turn, behind the
-- fan-out guard (the amplification rule, docs/rules.md#amplification).
--
-- Call it before the memory-tool call it describes. Once the turn's amplification
-- (span input tokens so far / the context's current occupancy) is above the
-- pathological threshold, further fan-out is refused with reason fanout_guard:
-- the agent should summarize and proceed instead of recalling again.
--
-- KEYS[1]  session hash
-- KEYS[2]  partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[3]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[4]  previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch[@turn]            integer; older than the session's -> LEDGER_STALE; @turn:
--                                  a call of that turn (see `fence`)
-- ARGV[3]  turn                    the current turn, 0..1e15
-- ARGV[4]  kind                    recall, rerank, fetch, write, prune, summarize, ... (an id)
-- ARGV[5]  input tokens            0..1e8
-- ARGV[6]  output tokens           0..1e8
--
-- Mode: mutating
-- Reply: status=ok|turn=<n>|spans=<n>|span_input=<tokens>|ratio=<per mille>|epoch=<n>
--    or  status=refused|reason=fanout_guard|requested=<input tokens>|ratio=<per mille>
--          |threshold=<per mille>|advice=summarize_and_proceed|free=<tokens>|epoch=<n>|turn=<n>
-- Errors: LEDGER_BADARG, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED,
--         LEDGER_TURNLOST (the turn is not open: ended, rolled back or followed by another).
-- Calls: HMGET, TIME, HSET (HINCRBY on refusal; HMGET of the op's outcome bucket and the epoch base e, HSET of the bucket; a PEXPIRE, or the outcome generations' RENAME and PEXPIRE, when due).

local op, fp, epoch = op_args('record_span', false)
local turn, kind, tin, tout
turn = int_arg(ARGV[3], 'turn', 0, 1e15)
kind = id_arg(ARGV[4], 'span kind')
tin = int_arg(ARGV[5], 'input tokens', 0, TOKENS_MAX)
tout = int_arg(ARGV[6], 'output tokens', 0, TOKENS_MAX)
if #ARGV ~= 6 then fail('BADARG', 'expected 6 arguments, got ' .. #ARGV) end

local key = KEYS[1]
local H, R = load(key, { 'ep', 'tn', 'S', 'T', 'a_w', 'a_rm', 'a_s', 'fr', 'ai', 'ao', 'an', 'amp', 'gz', 'xp',
  'te', 'lo', 'uo' }, 15)
local again = gate(recorded(op), H.ep, op, fp, epoch)
if again then return again end
local in_turn = fence(key, R[1], H.tn, turn, true)
local now = now_ms()
local prompt = math.max(1, H.S + H.T + H.a_w + H.a_rm + H.a_s)
local ratio = math.floor(H.ai * 1000 / prompt)
local J = { gz = H.gz, xp = H.xp, uo = in_turn and (R[2] or '') or nil }
-- rule: fanout-guard (the demo's rule tests replace the next line)
if ratio > H.amp then
  indicate(key, 'fanout_refused', 1)
  return commit(key, now, op, fp, table.concat({ 'status=refused|reason=fanout_guard|requested=', tin,
    '|ratio=', ratio, '|threshold=', H.amp, '|advice=summarize_and_proceed|free=', H.fr,
    '|epoch=', H.ep, '|turn=', H.tn }), {}, J)
end
local ai = H.ai + tin
return commit(key, now, op, fp, table.concat({ 'status=ok|turn=', H.tn, '|spans=', H.an + 1,
  '|span_input=', ai, '|ratio=', math.floor(ai * 1000 / prompt), '|epoch=', H.ep }),
  { 'ai', ai, 'ao', H.ao + tout, 'an', H.an + 1 }, J)
