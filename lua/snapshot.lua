-- snapshot.lua: read a session's numbers in one consistent step (read-only).
--
-- KEYS[1]  session hash
-- KEYS[2]  (optional) summaries  the session's summaries hash '<tag>:compacted:<session>': its field
--          '~' is '<worker>|<until ms>' while a worker computes the session's compaction
-- ARGV[1]  protocol version         the call's (docs/protocol.md#versions); another one
--                                  is LEDGER_VERSION
--
-- KEYS count: 1; 2 with the summaries hash
-- Mode: read-only
-- Reply: now=<ms>|<field>=<value>|... for every numeric field of the session hash
--        (see _common.lua), the last end_turn's drift (dt tolerance, dr drift, dp prompt,
--        df flagged) and x:<counter> telemetry counters; the client derives
--        utilization, residual working memory and regime from them. Then the open
--        turn: le its lease's end (0: no turn open), te the last turn ended, then
--        rzd=<ms, Redis's clock> and rzr=<reason> of a staged hard reset (rz: when it is
--        due and why; 0 and empty when none is staged for this epoch), and last
--        cm=<the last ended turn's commit mark> and lo=<owner> (each empty when there is
--        none): rzr, cm and lo are the fields that are not numbers;
--        with KEYS[2], before rzd, kw=<1|0>: whether a worker is computing a compaction now.
-- Errors: LEDGER_NOSESSION, LEDGER_VERSION (another protocol, or a session of a layout
--         these scripts do not read: its fields would be read as zeros).
-- Calls: HMGET, TIME, HGET (of rz; of KEYS[2] when given).

protocol_arg(ARGV[1])
if #ARGV ~= 1 then fail('BADARG', 'expected 1 argument, got ' .. #ARGV) end
local FIELDS = { 'ep', 'tn', 'sq', 'W', 'S', 'T', 'out', 'F_w', 'F_rm', 'HW', 'EV', 'fr',
  'a_w', 'a_rm', 'a_s', 'u_w', 'u_r', 'u_m', 'u_s', 'n_w', 'n_r', 'n_m', 'n_s',
  'v_w', 'v_r', 'v_m', 'v_s', 'nv', 'ttl', 'ort', 'cd', 'kf', 'kn', 'rq', 'ai', 'an', 'ws',
  'inc', 'ca', 'dt', 'dr', 'dp', 'df', 'kg', 'pm', 'kr', 'x:drift', 'x:reconciled', 'x:refused',
  'x:refused_pending', 'x:expired', 'x:spilled', 'x:starvation', 'x:failed_compactions', 'x:resets',
  'x:rolled_back', 'le', 'te', 'cm', 'lo' }
local v = redis.call('HMGET', KEYS[1], unpack(FIELDS))
if not v[1] then fail('NOSESSION', NOSESSION) end
layout_check(redis.call('HGET', KEYS[1], 'lv'))
local out = { 'now=' .. now_ms() }
-- A session opened before drift detection has no tolerance (dt): -1, not judged.
for i = 1, #FIELDS - 2 do out[#out + 1] = FIELDS[i] .. '=' .. (v[i] or (FIELDS[i] == 'dt' and '-1' or '0')) end
if KEYS[2] then
  local w = string.match(redis.call('HGET', KEYS[2], '~') or '', '|(%d+)$')
  out[#out + 1] = 'kw=' .. ((w and tonumber(w) > tonumber(string.sub(out[1], 5))) and '1' or '0')
end
-- A staged hard reset (rz, see `reset_staged`): when it is due and why (0 and empty: none).
local st = reset_staged(redis.call('HGET', KEYS[1], 'rz'), tonumber(v[1]))
out[#out + 1] = 'rzd=' .. (st and string.format('%d', st.due) or '0')
out[#out + 1] = 'rzr=' .. (st and st.reason or '')
out[#out + 1] = 'cm=' .. (v[#FIELDS - 1] or '')
out[#out + 1] = 'lo=' .. (v[#FIELDS] or '')
return reply(out)
