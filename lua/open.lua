-- open.lua: create a session with its budget, or confirm an identical one.
--
-- KEYS[1]  session hash
-- KEYS[2..6]  the session's data   '<tag>:content:<session>', '<tag>:compacted:<session>',
--                                  '<tag>:history:<session>', '<tag>:spill:<session>',
--                                  '<tag>:spilled:<session>': deleted when a new incarnation
--                                  is created (whatever an earlier one left is not its own)
-- KEYS[7]  partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[8]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[9]  previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch                   ignored on open (send 0); a new session starts at the epoch
--                                  Redis's clock gives in ms (above any earlier incarnation's),
--                                  or one above a closed session's tombstone if higher
-- ARGV[3]  window W                tokens, 1..1e8
-- ARGV[4]  system prompt S         tokens
-- ARGV[5]  tool framing T          tokens
-- ARGV[6]  working-memory floor Fw  tokens
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
--                                  before the drift is flagged, -1..1e8 (-1: drift is not judged)
-- ARGV[25] compaction owner        'worker' (the background worker compacts: compaction jobs
--                                  are enqueued) or 'agent' (the agent compacts inline through
--                                  compact; only a hard-reset escalation is enqueued)
-- ARGV[26] compaction min gain     tokens a compaction must free (occupancy before minus after);
--                                  one that frees less is a deferral, a failed compaction
--                                  (docs/rules.md#compaction-credit); 0..1e8 and at most the
--                                  window, 0: no minimum
--
-- Mode: mutating
-- Reply: status=ok|created=<0|1>|epoch=<n>|turn=<n>
-- Errors: LEDGER_BADARG, LEDGER_CONFIG (reserved floor, high-water mark, eviction threshold
--         or compaction min gain larger than the window),
--         LEDGER_CONFLICT (the session exists with another budget), LEDGER_OPREUSED.
-- Calls: HMGET, TIME, HSET, PEXPIRE, DEL.

-- SHA-256 (FIPS 180-4) of a string, as 64 lowercase hex digits, with Redis's `bit` library
-- (32-bit operations; sums are brought back to 32 bits with bit.tobit).
local K256 = {
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2 }

local function sha256hex(msg)
  local band, bor, bxor, bnot = bit.band, bit.bor, bit.bxor, bit.bnot
  local rshift, lshift, ror, tobit = bit.rshift, bit.lshift, bit.ror, bit.tobit
  local h = { 0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
    0x5be0cd19 }
  local bits = #msg * 8
  local hi, lo = math.floor(bits / 4294967296), bits % 4294967296
  local function be32(x)
    return string.char(math.floor(x / 16777216) % 256, math.floor(x / 65536) % 256,
      math.floor(x / 256) % 256, x % 256)
  end
  msg = msg .. '\128' .. string.rep('\0', (55 - #msg) % 64) .. be32(hi) .. be32(lo)
  local w = {}
  for i = 1, #msg, 64 do
    for j = 0, 15 do
      local a, b, c, d = string.byte(msg, i + 4 * j, i + 4 * j + 3)
      w[j] = bor(lshift(a, 24), lshift(b, 16), lshift(c, 8), d)
    end
    for j = 16, 63 do
      local x, y = w[j - 15], w[j - 2]
      w[j] = tobit(w[j - 16] + bxor(ror(x, 7), ror(x, 18), rshift(x, 3)) + w[j - 7] +
        bxor(ror(y, 17), ror(y, 19), rshift(y, 10)))
    end
    local a, b, c, d, e, f, g, hh = h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8]
    for j = 0, 63 do
      local t1 = tobit(hh + bxor(ror(e, 6), ror(e, 11), ror(e, 25)) +
        bxor(band(e, f), band(bnot(e), g)) + K256[j + 1] + w[j])
      local t2 = tobit(bxor(ror(a, 2), ror(a, 13), ror(a, 22)) +
        bxor(band(a, b), band(a, c), band(b, c)))
      hh, g, f, e, d, c, b, a = g, f, e, tobit(d + t1), c, b, a, tobit(t1 + t2)
    end
    h[1], h[2], h[3], h[4] = tobit(h[1] + a), tobit(h[2] + b), tobit(h[3] + c), tobit(h[4] + d)
    h[5], h[6], h[7], h[8] = tobit(h[5] + e), tobit(h[6] + f), tobit(h[7] + g), tobit(h[8] + hh)
  end
  for k = 1, 8 do h[k] = bit.tohex(h[k], 8) end
  return table.concat(h)
end

-- x * 1000 rounded to the nearest integer, ties to even (as the clients round per mille).
local function permille(x)
  local y = x * 1000
  local f = math.floor(y)
  local d = y - f
  if d > 0.5 or (d == 0.5 and f % 2 == 1) then f = f + 1 end
  return f
end

-- A JSON number as ECMAScript writes it (JSON.stringify, RFC 8785): an integral value as an
-- integer, any other in the fewest significant digits that read back the same, in decimal
-- notation from 1e-6 up (a smaller one as '<digits>e-<n>').
local function js_number(x)
  if x == math.floor(x) and math.abs(x) < 1e21 then
    return (string.gsub(string.format('%.0f', x), '^%-0$', '0'))
  end
  local s
  for p = 1, 17 do
    s = string.format('%.' .. p .. 'g', x)
    if tonumber(s) == x then break end
  end
  local sign, int, frac, exp = string.match(s, '^(%-?)(%d)%.?(%d*)e%-0*(%d+)$')
  if not int then return s end  -- (%g is in decimal notation here, as ECMAScript)
  exp = tonumber(exp)
  if exp <= 6 then return sign .. '0.' .. string.rep('0', exp - 1) .. int .. frac end
  return sign .. int .. (frac ~= '' and ('.' .. frac) or '') .. 'e-' .. exp
end

-- The canonical JSON (RFC 8785) of a decoded budget: keys sorted, no whitespace, numbers
-- as `js_number` writes them; `lists` names the fields that are lists (an empty one
-- decodes as an empty table). Strings of a budget are ASCII names, written as they are.
local function canonical(b, lists)
  local names = {}
  for name in pairs(b) do names[#names + 1] = name end
  table.sort(names)
  local function value(x, list)
    if x == cjson.null then return 'null' end
    if type(x) == 'number' then return js_number(x) end
    if type(x) == 'boolean' then return tostring(x) end
    if type(x) == 'table' and list then
      local parts = {}
      for i = 1, #x do parts[i] = value(x[i]) end
      return '[' .. table.concat(parts, ',') .. ']'
    end
    if type(x) == 'string' and string.match(x, '^[%w_]*$') then return '"' .. x .. '"' end
    fail('BADARG', 'budget json has a value that is no budget\'s: ' .. show(cjson.encode(x)))
  end
  local parts = {}
  for i, name in ipairs(names) do
    parts[i] = '"' .. name .. '":' .. value(b[name], lists[name])
  end
  return '{' .. table.concat(parts, ',') .. '}'
end

-- The budget json (canonical JSON of the budget, docs/protocol.md) must name every field
-- of the budget, and only those, with the values the other arguments were derived from.
local function budget_matches(json, v, rel, tol, owner, gain)
  local ok, b = pcall(cjson.decode, json)
  if not ok or type(b) ~= 'table' then fail('BADARG', 'budget json is not a JSON object') end
  local W = v[1]
  local function num(name)
    local x = b[name]
    if type(x) ~= 'number' then fail('BADARG', 'budget json has no number ' .. name) end
    return x
  end
  local codes = { working_memory = 'w', retrieval = 'r', recall = 'm', scratchpad = 's' }
  local got = {}
  if type(b.release_each_turn) ~= 'table' then
    fail('BADARG', 'budget json has no list release_each_turn')
  end
  for _, name in ipairs(b.release_each_turn) do
    if not codes[name] then fail('BADARG', 'budget json: no consumer named ' .. show(name)) end
    got[#got + 1] = codes[name]
  end
  table.sort(got)
  local tolerance = b.framing_tolerance
  if tolerance == cjson.null or tolerance == nil then tolerance = -1 end
  local checks = {
    { 'window', num('window'), W, 3 }, { 'system_prompt', num('system_prompt'), v[2], 4 },
    { 'tool_framing', num('tool_framing'), v[3], 5 },
    { 'working_memory_floor', num('working_memory_floor'), v[4], 6 },
    { 'min_memory', num('min_memory'), v[5], 7 }, { 'output_reserve', num('output_reserve'), v[6], 8 },
    { 'high_water_mark', math.floor(W * num('high_water_mark')), v[7], 9 },
    { 'eviction_threshold', math.floor(W * num('eviction_threshold')), v[8], 10 },
    { 'idle_ttl_seconds', num('idle_ttl_seconds') * 1000, v[9], 11 },
    { 'release_each_turn', #got > 0 and table.concat(got) or '-', rel, 15 },
    { 'spill_preview_tokens', num('spill_preview_tokens'), v[11], 16 },
    { 'spill_ttl_seconds', num('spill_ttl_seconds') * 1000, v[12], 17 },
    { 'max_failed_compactions', num('max_failed_compactions'), v[13], 18 },
    { 'rollup_turns', num('rollup_turns'), v[14], 19 },
    { 'rollup_fraction', permille(num('rollup_fraction')), v[15], 20 },
    { 'amplification_saturation', permille(num('amplification_saturation')), v[16], 21 },
    { 'amplification_fragmentation', permille(num('amplification_fragmentation')), v[17], 22 },
    { 'amplification_pathological', permille(num('amplification_pathological')), v[18], 23 },
    { 'framing_tolerance', tolerance, tol, 24 }, { 'compaction', b.compaction, owner, 25 },
    { 'compaction_min_gain', math.floor(W * num('compaction_min_gain')), gain, 26 },
  }
  local known = {}
  for _, c in ipairs(checks) do
    known[c[1]] = true
    if c[2] ~= c[3] then
      fail('BADARG', 'budget json gives ' .. c[1] .. ' as ' .. tostring(c[2]) .. ' but ARGV[' ..
        c[4] .. '] says ' .. tostring(c[3]) .. ': the arguments must be derived from the json')
    end
  end
  for name in pairs(b) do
    if not known[name] then fail('BADARG', 'budget json has an unknown field ' .. show(name)) end
  end
  -- One budget, one text, one fingerprint: the json must be written canonically (a
  -- '"window":8000.0' with its own SHA-256 would be the same budget under another one).
  local want = canonical(b, { release_each_turn = true })
  if want ~= json then
    local i = 1
    while string.byte(want, i) == string.byte(json, i) do i = i + 1 end
    fail('BADARG', 'budget json is not canonical (RFC 8785): at byte ' .. i .. ' expected ' ..
      show(string.sub(want, i)) .. ', got ' .. show(string.sub(json, i)))
  end
end

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
local B = { W = W, S = S, T = T, F_w = Fw, F_rm = Fm }
local floor = reserved_floor(B, out)
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
if type(cfp) ~= 'string' or #cfp ~= 64 or not string.match(cfp, '^[0-9a-f]+$') then
  fail('BADARG', 'budget fingerprint must be 64 lowercase hex digits (SHA-256), got ' .. show(cfp))
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
key_arg(2, 'content:%s', 'compacted:%s', 'history:%s', 'spill:%s', 'spilled:%s')

local key = KEYS[1]
local H, R = load(key, { 'ep', 'tn', 'pe', 'ort', 'cfg' }, 4)
local again = replay(recorded(op), op, fp)
if again then return again end
-- Nothing is taken on trust (the budget is shared by every client): the fingerprint must
-- be the SHA-256 of the JSON, and the JSON must say what the other arguments say.
if sha256hex(ARGV[14]) ~= cfp then
  fail('BADARG', 'budget fingerprint ' .. cfp .. ' is not the SHA-256 of the budget json ' ..
    show(ARGV[14]))
end
budget_matches(ARGV[14], v, rel, tol, owner, gain)
if H.ep then
  layout_check(redis.call('HGET', key, 'lv'))
  if R[1] ~= cfp then
    fail('CONFLICT', 'session is already open with another budget (fingerprint ' ..
      tostring(R[1]) .. '); asked for ' .. cfp .. ': ' .. ARGV[14])
  end
  if H.ort ~= v[10] then
    fail('CONFLICT', 'session is open with an op retention of ' .. H.ort .. ' ms; this client ' ..
      'keeps outcomes ' .. v[10] .. ' ms (every client of a session must retain them alike, ' ..
      'or a retry judged by the shorter one is applied twice)')
  end
  return reply({ 'status=ok', 'created=0', 'epoch=' .. H.ep, 'turn=' .. H.tn })
end

local now = now_ms()
local fr = free_room(B, out, 0, 0, 0)  -- (nothing is active yet)
-- A new incarnation's epoch is Redis's clock in ms (above a closed session's last
-- epoch): every epoch of an earlier incarnation of this id, even one whose keys were
-- lost (a restart without persistence, an eviction, an expiry), is older, so a handle
-- or a retry from before the loss is refused as stale instead of acting on the new
-- session.
local epoch = math.max((H.pe or 0) + 1, now)
local args = { 'lv', LAYOUT, 'cfg', cfp, 'ep', epoch, 'inc', now, 'tn', 0, 'sq', 0, 'ox', 0,
  'W', W, 'S', S, 'T', T, 'out', out, 'F_w', Fw, 'F_rm', Fm, 'HW', v[7], 'EV', v[8], 'fr', fr,
  'a_w', 0, 'a_rm', 0, 'a_s', 0, 'nv', 0, 'ttl', v[9], 'ort', v[10],
  'R0', out, 'rel', rel, 'pv', v[11], 'sttl', v[12], 'cx', v[13], 'rut', v[14], 'rup', v[15],
  'ams', v[16], 'amf', v[17], 'amp', v[18], 'dt', tol, 'ca', owner == 'agent' and 1 or 0,
  'kg', gain, 'pm', 0,
  'cd', 0, 'kf', 0, 'kr', 0, 'kn', 0, 'kt', 0, 'rq', 0, 'ws', 0, 'ai', 0, 'ao', 0, 'an', 0, 'pu', -1 }
zero_counters(args)
-- xp = 0: this commit refreshes the idle TTL; the outcome generation (which may hold
-- a deleted incarnation's outcomes) is rotated one op retention from now.
args[#args + 1] = 'gz'
args[#args + 1] = string.format('%d', now + v[10])
local out = commit(key, now, op, fp, reply({ 'status=ok', 'created=1', 'epoch=' .. epoch, 'turn=0' }),
  args, { gz = NEVER, xp = 0, ttl = v[9], ort = v[10] })
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])  -- (after the first write)
return out
