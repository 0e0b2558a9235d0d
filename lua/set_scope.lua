-- set_scope.lua: set a budget scope's window, ceilings and price table (docs/ceilings.md).
--
-- The operator's call. A scope is a tenant or a key or user within it; its counters are
-- kept (a new ceiling applies to what the window has charged already); its window and
-- bucket lengths cannot change while it holds counters (they name its buckets).
--
-- KEYS[1]  scope hash              '<tag>:t:<scope>'
-- ARGV[1]  protocol version        (LEDGER_VERSION, naming both, for another one)
-- ARGV[2]  operation id            [A-Za-z0-9._:/@+=#-]{1,128} (stored as the field op: the
--                                  call sets the whole configuration, so sending it again
--                                  changes nothing)
-- ARGV[3]  window                  ms, 1000..34560000000 (400 days)
-- ARGV[4]  bucket                  ms, the window itself (a fixed window) or a divisor of it
--                                  into at most 96 buckets (a rolling window)
-- ARGV[5]  hold limit              ms, 1..86400000: the longest lease a reservation may hold
-- ARGV[6]  input ceiling           tokens, or '-' for none
-- ARGV[7]  output ceiling          tokens, or '-'
-- ARGV[8]  cached input ceiling    tokens, or '-'
-- ARGV[9]  token ceiling           tokens of the counted kinds together, or '-'
-- ARGV[10] money ceiling           micro-cents, or '-'
-- ARGV[11] counted                 the kinds the token ceiling counts: letters of 'ioc', or '-'
-- ARGV[12] n                       prices, 0..256
-- ARGV[13..12+2n]  prices  model, '<input>|<output>|<cached input>' cents per million
--                                  tokens, per price ('*': any other model)
--
-- Mode: mutating
-- Reply: status=ok|prices=<n>
-- Errors: LEDGER_VERSION, LEDGER_BADARG, LEDGER_CONFIG (window or bucket changed while
--         counters are kept).
-- Calls: HMGET, HKEYS, HDEL, HSET (and HDEL of a layout 2 scope's live fields, moved into w).

protocol_arg(ARGV[1])
local op = id_arg(ARGV[2], 'operation id')
local L = int_arg(ARGV[3], 'window ms', 1000, 400 * 86400000)
local G = int_arg(ARGV[4], 'bucket ms', 1000, L)
local hl = int_arg(ARGV[5], 'hold limit ms', 1, 86400000)
if L % G ~= 0 or L / G > 96 then
  fail('BADARG', 'bucket ms must divide the window into 1..96 buckets, got ' .. L .. ' / ' .. G)
end
local cf = { L, G, hl, -1, -1, -1, -1, -1 }  -- (a ceiling: -1 for none)
for k, f in ipairs({ 'input', 'output', 'cached input', 'token', 'money' }) do
  if ARGV[5 + k] ~= '-' then cf[3 + k] = int_arg(ARGV[5 + k], f .. ' ceiling', 0, 1e15) end
end
local counted = ARGV[11]
if type(counted) ~= 'string' or not string.match(counted, '^[ioc-]+$') or #counted > 3 or
    (counted ~= '-' and string.find(counted, '-', 1, true)) then
  fail('BADARG', "counted must be letters of 'ioc' or '-', got " .. show(counted))
end
local n = int_arg(ARGV[12], 'price count', 0, 256)
if #ARGV ~= 12 + 2 * n then fail('BADARG', 'expected ' .. (12 + 2 * n) .. ' arguments, got ' .. #ARGV) end
local prices = {}
for k = 1, n do
  local model = ARGV[11 + 2 * k]
  if model ~= '*' then model = id_arg(model, 'model') end
  local p = ARGV[12 + 2 * k]
  if type(p) ~= 'string' or not string.match(p, '^%d+|%d+|%d+$') or #p > 40 then
    fail('BADARG', "a price must be '<input>|<output>|<cached input>' cents per million tokens, got " .. show(p))
  end
  prices[#prices + 1], prices[#prices + 2] = 'p:' .. model, p
end

local hk = KEYS[1]
local was = redis.call('HMGET', hk, 'L', 'G', 'bl', 'w', 'wb', 'wi', 'wo', 'wc', 'w$', 'wn', 'nd', 'cf')
local wL, wG = was[1], was[2]  -- (layout 2 keeps them as fields, layout 3 in cf)
if was[12] then
  local cL, cG = struct.unpack(SCOPE_CF, was[12])
  wL, wG = tostring(cL), tostring(cG)
end
if ((was[3] and was[3] ~= '') or was[4]) and (tonumber(wL) ~= L or tonumber(wG) ~= G) then
  fail('CONFIG', 'the window and bucket of a scope with counters cannot change (' .. wL .. '/' .. wG .. ' ms)')
end
local old = {}
for _, f in ipairs(redis.call('HKEYS', hk)) do
  if string.sub(f, 1, 2) == 'p:' or string.sub(f, 1, 2) == 'c_' then old[#old + 1] = f end
end
if #old > 0 then redis.call('HDEL', hk, unpack(old)) end
local k = counted == '-' and '' or counted
-- (no plain 'L': a script of protocol 2 finds no scope here and refuses, LEDGER_NOSCOPE,
-- rather than read a scope of layout 3 as one without ceilings)
local w = { 'op', op }
cf[9] = (string.find(k, 'i', 1, true) and 1 or 0) + (string.find(k, 'o', 1, true) and 2 or 0) +
  (string.find(k, 'c', 1, true) and 4 or 0)
w[#w + 1], w[#w + 2] = 'cf', struct.pack(SCOPE_CF, unpack(cf))
if not was[4] and was[5] then  -- a scope of layout 2: its live counters move into w
  w[#w + 1], w[#w + 2] = 'w', struct.pack(SCOPE_W, tonumber(was[5]), tonumber(was[6]) or 0, tonumber(was[7]) or 0,
    tonumber(was[8]) or 0, tonumber(was[9]) or 0, tonumber(was[10]) or 0, tonumber(was[11]) or NEVER)
end
if not was[4] and (was[5] or was[11]) then redis.call('HDEL', hk, 'wb', 'wi', 'wo', 'wc', 'w$', 'wn', 'nd') end
if was[1] then redis.call('HDEL', hk, 'L', 'G', 'hl', 'k') end  -- (layout 2's config, now in cf)
for _, v in ipairs(prices) do w[#w + 1] = v end
redis.call('HSET', hk, unpack(w))
return reply({ 'status=ok', 'prices=' .. n })
