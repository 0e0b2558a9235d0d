-- open.lua: create a session with its budget, or confirm an identical one.
--
-- KEYS[1]  session hash
-- KEYS[2]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[3]  previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch                   ignored on open (send 0); a new session starts at the epoch
--                                  Redis's clock gives in ms (above any earlier incarnation's),
--                                  or one above a closed session's tombstone if higher
-- ARGV[3]  window W                tokens, 1..1e8
-- ARGV[4]  system prompt S         tokens
-- ARGV[5]  tool framing T          tokens
-- ARGV[6]  working-memory floor Fw tokens
-- ARGV[7]  minimum memory Fm       tokens (floor of retrieval + recall)
-- ARGV[8]  output reserve          tokens, the default per turn
-- ARGV[9]  high-water mark H       tokens (occupancy above it makes a compaction due)
-- ARGV[10] eviction threshold      tokens (utilization above it is the loud regime)
-- ARGV[11] idle TTL                milliseconds, 1000..31536000000 (one year)
-- ARGV[12] op retention            milliseconds an outcome is kept for retries, 1000..86400000
-- ARGV[13] budget fingerprint      hex over the whole budget (open is idempotent per fingerprint)
-- ARGV[14] budget json             named in a CONFLICT error (only the fingerprint is stored,
--                                  so a fresh session's hash stays in Redis's compact encoding)
-- ARGV[15] released each turn      consumer codes released at every begin_turn ('-' none), e.g. 'r'
-- ARGV[16] spill preview           tokens admitted in place of a spilled tool result, 1..1e8
-- ARGV[17] spill TTL               milliseconds a spilled result stays readable, 1000..31536000000
-- ARGV[18] failed compactions      consecutive failures that escalate to a hard reset, 1..100
-- ARGV[19] roll-up turns           turns since the last compaction that raise the roll-up hint
-- ARGV[20] roll-up share           per mille of working memory's budget that raises it, 1..1000
-- ARGV[21..23] amplification       saturation, fragmentation, pathological thresholds, per mille
-- ARGV[24] framing tolerance       tokens the real prompt may differ from occupancy at end_turn
--                                  before the drift is flagged, 0..1e8; -1: drift is not judged
-- ARGV[25] compaction owner        'worker' (the background worker compacts: compaction jobs
--                                  are enqueued) or 'agent' (the agent compacts inline through
--                                  compact; only a hard-reset escalation is enqueued)
-- ARGV[26] compaction min gain     tokens a compaction must free (occupancy before minus after);
--                                  one that frees less is a deferral, a failed compaction
--                                  (docs/rules.md#compaction-credit); 0..window, 0: no minimum
--
-- Reply: status=ok|created=<0|1>|epoch=<n>|turn=<n>
-- Errors: LEDGER_BADARG, LEDGER_CONFIG (reserved floor, high-water mark, eviction threshold
--         or compaction min gain larger than the window),
--         LEDGER_CONFLICT (the session exists with another budget), LEDGER_OPREUSED.
-- Calls: HMGET, TIME, HSET, PEXPIRE.

local op, fp = op_args('open')
local names = { 'window', 'system_prompt', 'tool_framing', 'working_memory_floor', 'min_memory',
  'output_reserve', 'high_water_mark', 'eviction_threshold', 'idle_ttl_ms', 'op_retention_ms' }
local lo = { 1, 0, 0, 0, 0, 0, 0, 0, 1000, 1000 }
local hi = { TOKENS_MAX, TOKENS_MAX, TOKENS_MAX, TOKENS_MAX, TOKENS_MAX, TOKENS_MAX, TOKENS_MAX,
  TOKENS_MAX, 31536000000, 86400000 }
local v = {}
for k = 1, #names do
  v[k] = int_arg(ARGV[2 + k], names[k], lo[k], hi[k])
end
local rel = ARGV[15]
if type(rel) ~= 'string' or not (rel == '-' or string.match(rel, '^[wrms]+$')) then
  fail('BADARG', 'released-each-turn consumers must be - or letters of wrms, got ' .. show(rel))
end
local names2 = { 'spill_preview_tokens', 'spill_ttl_ms', 'max_failed_compactions', 'rollup_turns',
  'rollup_permille', 'amplification_saturation', 'amplification_fragmentation',
  'amplification_pathological' }
local lo2 = { 1, 1000, 1, 1, 1, 1, 1, 1 }
local hi2 = { TOKENS_MAX, 31536000000, 100, 1000000, 1000, 1000000, 1000000, 1000000 }
for k = 1, #names2 do
  v[10 + k] = int_arg(ARGV[15 + k], names2[k], lo2[k], hi2[k])
end
local W, S, T, Fw, Fm, out = v[1], v[2], v[3], v[4], v[5], v[6]
local floor = S + T + Fw + Fm + out
if floor > W then
  fail('CONFIG', 'reserved floor ' .. floor .. ' (system_prompt ' .. S .. ' + tool_framing ' .. T ..
    ' + working_memory_floor ' .. Fw .. ' + min_memory ' .. Fm .. ' + output_reserve ' .. out ..
    ') exceeds window ' .. W)
end
if v[7] > W or v[8] > W then
  fail('CONFIG', 'high_water_mark ' .. v[7] .. ' and eviction_threshold ' .. v[8] ..
    ' must not exceed window ' .. W)
end
local cfp = ARGV[13]
if type(cfp) ~= 'string' or not string.match(cfp, '^%x+$') or #cfp > 64 then
  fail('BADARG', 'budget fingerprint must be 1-64 hex digits, got ' .. show(cfp))
end
if type(ARGV[14]) ~= 'string' or #ARGV[14] > 4096 then
  fail('BADARG', 'budget json must be at most 4096 bytes')
end
local tol
tol = int_arg(ARGV[24], 'framing tolerance', -1, TOKENS_MAX)
local owner = ARGV[25]
if owner ~= 'worker' and owner ~= 'agent' then
  fail('BADARG', 'compaction owner must be worker or agent, got ' .. show(owner))
end
local gain
gain = int_arg(ARGV[26], 'compaction_min_gain', 0, TOKENS_MAX)
if gain > W then
  fail('CONFIG', 'compaction_min_gain ' .. gain .. ' must not exceed window ' .. W)
end
if #ARGV ~= 26 then fail('BADARG', 'expected 26 arguments, got ' .. #ARGV) end

local key = KEYS[1]
local H, R = load(key, { 'ep', 'tn', 'pe', 'cfg' }, 3)
local again = replay(recorded(op), op, fp)
if again then return again end
if H.ep then
  if R[1] ~= cfp then
    fail('CONFLICT', 'session is already open with another budget (fingerprint ' ..
      tostring(R[1]) .. '); asked for ' .. cfp .. ': ' .. ARGV[14])
  end
  return reply({ 'status=ok', 'created=0', 'epoch=' .. H.ep, 'turn=' .. H.tn })
end

local now = now_ms()
local fr = W - floor
-- A new incarnation's epoch is Redis's clock in ms (above a closed session's last
-- epoch): every epoch of an earlier incarnation of this id, even one whose keys were
-- lost (a restart without persistence, an eviction, an expiry), is older, so a handle
-- or a retry from before the loss is refused as stale instead of acting on the new
-- session.
local epoch = math.max((H.pe or 0) + 1, now)
local args = { 'cfg', cfp, 'ep', epoch, 'inc', now, 'tn', 0, 'sq', 0,
  'W', W, 'S', S, 'T', T, 'out', out, 'F_w', Fw, 'F_m', Fm, 'HW', v[7], 'EV', v[8], 'fr', fr,
  'a_w', 0, 'a_m', 0, 'a_s', 0, 'nv', 0, 'ttl', v[9], 'ort', v[10],
  'R0', out, 'rel', rel, 'pv', v[11], 'sttl', v[12], 'cx', v[13], 'rut', v[14], 'rup', v[15],
  'ams', v[16], 'amf', v[17], 'amp', v[18], 'dt', tol, 'ca', owner == 'agent' and 1 or 0,
  'kg', gain, 'pm', 0,
  'cd', 0, 'kf', 0, 'kn', 0, 'kt', 0, 'rq', 0, 'ws', 0, 'ai', 0, 'ao', 0, 'an', 0, 'pu', -1 }
zero_counters(args)
-- xp = 0: this commit refreshes the idle TTL; the outcome generation (which may hold
-- a deleted incarnation's outcomes) is rotated one op retention from now.
args[#args + 1] = 'gz'
args[#args + 1] = string.format('%d', now + v[10])
return commit(key, now, op, fp, reply({ 'status=ok', 'created=1', 'epoch=' .. epoch, 'turn=0' }), args,
  { gz = NEVER, xp = 0, ttl = v[9], ort = v[10] })
