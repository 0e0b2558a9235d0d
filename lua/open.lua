-- open.lua: create a session with its budget, or confirm an identical one.
--
-- KEYS[1]  session hash
-- ARGV[1]  operation id            ARGV[2] argument fingerprint (hex)
-- ARGV[3]  epoch                   ignored on open (send 0); a new session starts at epoch 1
-- ARGV[4]  window W                tokens, 1..1e8
-- ARGV[5]  system prompt S         tokens
-- ARGV[6]  tool framing T          tokens
-- ARGV[7]  working-memory floor Fw tokens
-- ARGV[8]  minimum memory Fm       tokens (floor of retrieval + recall)
-- ARGV[9]  output reserve          tokens, the default per turn
-- ARGV[10] high-water mark H       tokens (occupancy above it makes a compaction due)
-- ARGV[11] eviction threshold      tokens (utilization above it is the loud regime)
-- ARGV[12] idle TTL                milliseconds, 1000..31536000000 (one year)
-- ARGV[13] op retention            milliseconds an outcome is kept for retries, 1000..86400000
-- ARGV[14] budget fingerprint      hex over the whole budget (open is idempotent per fingerprint)
-- ARGV[15] budget json             stored for inspection only
--
-- Reply: status=ok|created=<0|1>|epoch=<n>|turn=<n>
-- Errors: LEDGER_BADARG, LEDGER_CONFIG (reserved floor larger than the window),
--         LEDGER_CONFLICT (the session exists with another budget), LEDGER_OPREUSED.
-- Calls: HMGET, TIME, HSET, PEXPIRE.

local op, fp, _, e = op_args()
if e then return e end
local names = { 'window', 'system_prompt', 'tool_framing', 'working_memory_floor', 'min_memory',
  'output_reserve', 'high_water_mark', 'eviction_threshold', 'idle_ttl_ms', 'op_retention_ms' }
local lo = { 1, 0, 0, 0, 0, 0, 0, 0, 1000, 1000 }
local hi = { TOKENS_MAX, TOKENS_MAX, TOKENS_MAX, TOKENS_MAX, TOKENS_MAX, TOKENS_MAX, TOKENS_MAX,
  TOKENS_MAX, 31536000000, 86400000 }
local v = {}
for k = 1, #names do
  v[k], e = int_arg(ARGV[3 + k], names[k], lo[k], hi[k])
  if e then return e end
end
local W, S, T, Fw, Fm, out = v[1], v[2], v[3], v[4], v[5], v[6]
local floor = S + T + Fw + Fm + out
if floor > W then
  return err('CONFIG', 'reserved floor ' .. floor .. ' (system_prompt ' .. S .. ' + tool_framing ' .. T ..
    ' + working_memory_floor ' .. Fw .. ' + min_memory ' .. Fm .. ' + output_reserve ' .. out ..
    ') exceeds window ' .. W)
end
if v[7] > W or v[8] > W then
  return err('CONFIG', 'high_water_mark ' .. v[7] .. ' and eviction_threshold ' .. v[8] ..
    ' must not exceed window ' .. W)
end
local cfp = ARGV[14]
if type(cfp) ~= 'string' or not string.match(cfp, '^%x+$') or #cfp > 64 then
  return err('BADARG', 'budget fingerprint must be 1-64 hex digits, got ' .. show(cfp))
end
if type(ARGV[15]) ~= 'string' or #ARGV[15] > 4096 then
  return err('BADARG', 'budget json must be at most 4096 bytes')
end
if #ARGV ~= 15 then return err('BADARG', 'expected 15 arguments, got ' .. #ARGV) end

local key = KEYS[1]
local H, R = load(key, { 'ep', 'tn', 'o:' .. op, 'cfg', 'ol' }, 2)
local again = replay(R[1], op, fp)
if again then return again end
if H.ep then
  local have = string.match(R[2], '^(%x+)|')
  if have ~= cfp then
    return err('CONFLICT', 'session is already open with another budget (fingerprint ' .. have ..
      ', asked ' .. cfp .. '): ' .. string.sub(R[2], #have + 2))
  end
  return reply({ 'status=ok', 'created=0', 'epoch=' .. H.ep, 'turn=' .. H.tn })
end

local now = now_ms()
local fr = W - floor
local args = { 'cfg', cfp .. '|' .. ARGV[15], 'ep', 1, 'tn', 0, 'sq', 0,
  'W', W, 'S', S, 'T', T, 'out', out, 'F_w', Fw, 'F_m', Fm, 'HW', v[7], 'EV', v[8], 'fr', fr,
  'a_w', 0, 'a_m', 0, 'a_s', 0, 'nv', 0, 'ttl', v[9], 'ort', v[10], 'cl', 0, 'ch', 0 }
zero_counters(args)
-- xp = 0 and gz = NEVER: the first commit refreshes the idle TTL.
args[#args + 1] = 'gz'
args[#args + 1] = string.format('%d', NEVER)
return commit(key, now, op, fp, reply({ 'status=ok', 'created=1', 'epoch=1', 'turn=0' }), args,
  { ol = R[3], gz = NEVER, xp = 0, cl = 0, ch = 0, ttl = v[9], ort = v[10] })
