-- _common.lua: helpers shared by every ledger script.
--
-- The loader (ledger/scripts.py) prepends to each operation script the definitions
-- below that it uses, so every shipped script is one self-contained chunk. Only
-- `local` definitions at top level: each is cut with the comment lines above it.
-- Nothing here builds a key name: keys arrive only through KEYS.
--
-- Session hash (KEYS[1] of every session script), one Redis hash:
--   ep tn sq inc        epoch, turn, item sequence, creation time (ms) of this incarnation
--   pe                  (tombstone of a closed session) its last epoch
--   W S T out           window, system prompt, tool framing, output reserve (tokens)
--   F_w F_m             working-memory floor, memory (retrieval + recall) floor
--   HW EV               high-water mark, eviction threshold (tokens)
--   fr                  free tokens: W minus every claim (kept exact by every script)
--   a_w a_m a_s         active tokens (items + reservations) per group: working
--                       memory, memory (retrieval + recall), scratchpad
--   u_<c> n_<c> v_<c>   tokens held by items, item count, tokens held by open
--                       reservations, per consumer c
--   nv                  open reservations
--   ttl ort xp          idle TTL (ms), op retention (ms), when the TTL is next refreshed
--   R0 rel pv sttl      default output reserve, consumers released each turn, spill
--                       preview (tokens), spill TTL (ms)
--   cx rut rup          failed compactions that escalate, roll-up turns, roll-up share (per mille)
--   ams amf amp         amplification thresholds (per mille): saturation, fragmentation,
--                       pathological
--   cd kf kn kt rq      compaction pending, consecutive failed compactions, compactions
--                       done, turn of the last one, hard reset requested
--   kg pm               a compaction's minimum gain (tokens); memory (retrieval + recall)
--                       tokens admitted since the pending compaction became pending
--   ws ai ao an pu      this turn's working set, span input and output tokens, span
--                       count; utilization (per mille) at the last end_turn
--   cfg                 the budget's fingerprint
--   i:<c>:<id>          one item: '<tokens>|<turn>|<priority>|<seq>'
--   r:<id>              one reservation: '<c>|<tokens>|<deadline_ms>'
--   o:<op>              one outcome: '<ts_ms>|<fingerprint>|<reply>'
--   ol                  op ids of the open journal chunk, comma-separated
--   oc:<n> cl ch gz     closed journal chunks '<ts_ms>|<op ids>', oldest live chunk,
--                       next chunk, when chunk cl falls out of the op retention
--   x:<name>            telemetry counters
-- Consumers c: w working memory, r retrieval, m recall, s scratchpad.

local GROUP = { w = 'w', r = 'm', m = 'm', s = 's' }
local ID_MAX = 128
local TOKENS_MAX = 100000000      -- 1e8 tokens: above any model's window
local CHUNK_BYTES = 512           -- journal chunk size
local NEVER = 999999999999999

-- Refuse the call: raise a tagged error, which the wrapper every script runs in (see
-- ledger/scripts.py) sends as the error reply 'LEDGER_<code> <msg>'. Any other error
-- (a Redis command's) passes through the wrapper unchanged.
local function fail(code, msg)
  error({ ledger = code, msg = msg })
end

local function show(v)
  if type(v) ~= 'string' then return tostring(v) end
  local s = string.gsub(string.sub(v, 1, 48), '[^%w%p ]', '?')
  if #v > 48 then s = s .. '...' end
  return "'" .. s .. "'"
end

-- A decimal integer in [lo, hi]; returns n, or fails with BADARG. `of`, when
-- given, names the item the number belongs to (joined only on error).
local function int_arg(v, name, lo, hi, of)
  local n = type(v) == 'string' and #v <= 16 and string.match(v, '^%-?%d+$') and tonumber(v)
  if n and n >= lo and n <= hi then return n + 0 end  -- + 0: '-0' is 0
  if of then name = name .. ' of ' .. of end
  if not n then fail('BADARG', name .. ' must be an integer, got ' .. show(v)) end
  fail('BADARG', name .. ' must be between ' .. lo .. ' and ' .. hi .. ', got ' .. v)
end

-- An identifier: 1..128 characters of [A-Za-z0-9._:/@+=#-]: no braces, no separators.
local function id_arg(v, name)
  if type(v) == 'string' and #v <= ID_MAX and string.find(v, '^[%w%._:/@%+=#%-]+$') then return v end
  fail('BADARG', name .. ' must be 1-' .. ID_MAX .. ' characters of [A-Za-z0-9._:/@+=#-], got ' .. show(v))
end

-- The session id in ARGV (a member prefix of the deadline index, a job's session)
-- must be exactly the one KEYS[1] names: '<prefix>:{p<N>}:s:<session id>' (a prefix
-- has no braces, so the first '{p<N>}' is the hash tag).
local function session_arg(v)
  local sid = id_arg(v, 'session id')
  if string.match(KEYS[1] or '', '^[^{]*{p%d+}:s:(.+)$') ~= sid then
    fail('BADARG', 'session id ' .. sid .. ' does not name the session key ' .. show(KEYS[1]))
  end
  return sid
end

-- KEYS[i] must be the partition key `suffix` of the session in KEYS[1]
-- ('<prefix>:{p<N>}:s:<session>'); '%s' in suffix stands for the session id. The name
-- is only compared, never used to reach a key: the scripts use KEYS as given.
local function key_arg(i, suffix)
  local tag, sid = string.match(KEYS[1] or '', '^([^{]*{p%d+}):s:(.+)$')
  local want = tag and (tag .. ':' .. string.format(suffix, sid))
  if not want or KEYS[i] ~= want or #KEYS ~= i then
    fail('BADARG', 'KEYS must be the session key and ' .. show(want or suffix) .. ', got ' ..
      #KEYS .. ' keys: ' .. show(KEYS[i]))
  end
end

local function consumer_arg(v)
  if type(v) ~= 'string' or not GROUP[v] then
    fail('BADARG', 'consumer must be one of w (working_memory), r (retrieval), m (recall), ' ..
      's (scratchpad), got ' .. show(v))
  end
  return v
end

-- A consumer's name as the clients spell it, for messages (built only when asked).
local function consumer_name(c)
  return ({ w = 'working_memory', r = 'retrieval', m = 'recall', s = 'scratchpad' })[c] or c
end

-- The prologue of every mutating call: ARGV[1] op id, ARGV[2] the epoch the caller
-- believes current ('*' where the script allows an unfenced call). Returns op, the
-- call's fingerprint and epoch (nil for '*'), or fails with BADARG. The fingerprint is
-- computed here, by the server, over the script's name and every argument after the op
-- id (the first 12 hex digits of their SHA-1): a client cannot claim one, so an op id
-- sent again with other arguments is always refused, whatever the client.
local function op_args(name, unfenced_ok)
  local op = id_arg(ARGV[1], 'operation id')
  local fp = string.sub(redis.sha1hex(name .. '\31' .. table.concat(ARGV, '\31', 2)), 1, 12)
  if unfenced_ok and ARGV[2] == '*' then return op, fp, nil end
  return op, fp, int_arg(ARGV[2], 'epoch', 0, 1e15)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A stored outcome for this op id: the reply to send again, or nil when the op is
-- new; fails with OPREUSED when the id was used with other arguments.
local function replay(rec, op, fp)
  if not rec then return nil end
  local rfp, out = string.match(rec, '^%d+|(%x+)|(.*)$')
  if rfp ~= fp then
    fail('OPREUSED', 'operation id ' .. op .. ' was already used with other arguments')
  end
  return out
end

local NOSESSION = 'session does not exist (never opened, closed or expired)'

local function stale(ep, epoch)
  if epoch == nil or epoch == ep then return end
  if epoch < ep then
    fail('STALE', 'epoch ' .. epoch .. ' is older than the session epoch ' .. ep)
  end
  fail('BADARG', 'epoch ' .. epoch .. ' is newer than the session epoch ' .. ep)
end

-- The checks every mutating call makes once its fields are read, given the field
-- 'o:<op>' (rec) and the session's epoch (ep, a number or nil), in this order: a
-- stored outcome is replayed, a missing session and a stale epoch are refused.
-- Returns the stored reply to send again, or nil to go on (else it fails).
local function gate(rec, ep, op, fp, epoch)
  local again = replay(rec, op, fp)
  if again then return again end
  if not ep then fail('NOSESSION', NOSESSION) end
  stale(ep, epoch)
end

-- record_span and end_turn account only the session's current turn, and only until
-- it ends: BADARG otherwise.
local function open_turn(H, turn)
  if turn ~= H.tn then
    fail('BADARG', 'turn ' .. turn .. ' is not the current turn ' .. H.tn)
  end
  if H.te == turn then
    fail('BADARG', 'turn ' .. turn .. ' has already ended')
  end
end

-- settle and void: the open reservation { c, est, deadline }, or nil and the stored
-- reply to send again; fails on a missing session, a stale epoch (checked before
-- the reservation, which a reset drops), or no such reservation.
local function open_reservation(key, op, fp, epoch, rid)
  local v = redis.call('HMGET', key, 'o:' .. op, 'ep', 'r:' .. rid)
  local again = gate(v[1], tonumber(v[2]), op, fp, epoch)
  if again then return nil, again end
  if not v[3] then fail('NORESERVATION', 'reservation ' .. rid .. ' is not open') end
  local c, est, deadline = string.match(v[3], '^(%a)|(%d+)|(%d+)$')
  return { c = c, est = tonumber(est), deadline = tonumber(deadline) }
end

-- Append 'u_<c>', 0, 'n_<c>', 0, 'v_<c>', 0 for every consumer (open, reset).
local function zero_counters(args)
  for _, c in ipairs({ 'w', 'r', 'm', 's' }) do
    for _, p in ipairs({ 'u_', 'n_', 'v_' }) do
      args[#args + 1] = p .. c
      args[#args + 1] = 0
    end
  end
  return args
end

-- HMGET fields: the first nnum are numbers (into H, by name), the rest raw values
-- (into R, in order; false where absent).
local function load(key, fields, nnum)
  local v = redis.call('HMGET', key, unpack(fields))
  local H, R = {}, {}
  for i = 1, nnum do H[fields[i]] = tonumber(v[i]) end
  for i = nnum + 1, #fields do R[i - nnum] = v[i] end
  return H, R
end

-- How much a group's claim on the window grows when its active tokens move from
-- a to a + d: claims are max(active, floor), so tokens inside a floor are free.
local function claim_delta(a, d, floor)
  return math.max(a + d, floor) - math.max(a, floor)
end

-- Why `requested` tokens did not fit: floor_protected when the window has that much
-- unclaimed room but it lies inside another consumer's floor, else
-- token_budget_exhausted. Only called on the refusal path.
local function refusal_reason(key, requested)
  local v = redis.call('HMGET', key, 'W', 'S', 'T', 'out', 'a_w', 'a_m', 'a_s')
  local room = tonumber(v[1]) - tonumber(v[2]) - tonumber(v[3]) - tonumber(v[4]) - tonumber(v[5])
    - tonumber(v[6]) - tonumber(v[7])
  if requested <= room then return 'floor_protected' end
  return 'token_budget_exhausted'
end

-- Append a job for the workers to the partition's stream (KEYS of the caller), in
-- the same atomic step as the state change that needs it (docs/rules.md#jobs-in-the-same-step).
-- Whether the background worker compacts the session (compaction jobs are enqueued for
-- it); an agent-owned session ('ca' = 1) compacts inline and gets no compaction jobs.
local function worker_compacts(key)
  return redis.call('HGET', key, 'ca') ~= '1'
end

local function enqueue(stream, kind, sid, epoch, op, reason)
  local inc = redis.call('HGET', KEYS[1], 'inc')
  redis.call('XADD', stream, '*', 'kind', kind, 'session', sid, 'epoch', epoch, 'reason', reason,
    'op', op, 'inc', inc or '0')
end

-- Record the outcome under its op id and write args (field, value, ...) in one
-- HSET. Rarely (chunk full, retention passed, TTL due) it also closes a journal
-- chunk, drops the oldest one with its outcomes, or refreshes the idle TTL, so
-- the work per call stays constant whatever the session's length.
-- J: { ol = raw 'ol', gz = number, xp = number } and, where the caller knows
-- them already, cl, ch, ttl, ort.
local function commit(key, now, op, fp, out, args, J)
  args[#args + 1] = 'o:' .. op
  args[#args + 1] = string.format('%d|%s|%s', now, fp, out)
  local ol = (J.ol and J.ol ~= '') and (J.ol .. ',' .. op) or op
  local refresh = now >= J.xp
  if refresh or now >= J.gz or #ol >= CHUNK_BYTES then
    if not J.ttl then
      local m = redis.call('HMGET', key, 'cl', 'ch', 'ttl', 'ort')
      J.cl, J.ch, J.ttl, J.ort = tonumber(m[1]), tonumber(m[2]), tonumber(m[3]), tonumber(m[4])
    end
    local cl, ch, ttl, ort = J.cl, J.ch, J.ttl, J.ort
    local gz = J.gz
    if now >= gz and cl < ch then
      local g = redis.call('HMGET', key, 'oc:' .. cl, 'oc:' .. (cl + 1))
      local dead = { 'oc:' .. cl }
      for id in string.gmatch(string.match(g[1] or '0|', '^%d+|(.*)$'), '[^,]+') do
        dead[#dead + 1] = 'o:' .. id
      end
      redis.call('HDEL', key, unpack(dead))
      cl = cl + 1
      gz = g[2] and (tonumber(string.match(g[2], '^(%d+)|')) + ort) or NEVER
    end
    if #ol >= CHUNK_BYTES then
      args[#args + 1] = 'oc:' .. ch
      args[#args + 1] = now .. '|' .. ol
      if cl == ch then gz = now + ort end
      ch, ol = ch + 1, ''
    end
    local xp = J.xp
    if refresh then xp = now + math.floor(ttl / 10) end
    for _, kv in ipairs({ { 'cl', cl }, { 'ch', ch }, { 'gz', gz }, { 'xp', xp } }) do
      args[#args + 1] = kv[1]
      args[#args + 1] = string.format('%d', kv[2])
    end
    args[#args + 1] = 'ol'
    args[#args + 1] = ol
    redis.call('HSET', key, unpack(args))
    if refresh then redis.call('PEXPIRE', key, ttl) end
    return out
  end
  args[#args + 1] = 'ol'
  args[#args + 1] = ol
  redis.call('HSET', key, unpack(args))
  return out
end

-- key=value pairs joined by '|': the one reply shape of every script.
local function reply(kv)
  return table.concat(kv, '|')
end
