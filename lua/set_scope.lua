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
-- ARGV[3]  window                  ms, 1000..400 days
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
-- ARGV[13..12+2n]                  model, '<input>|<output>|<cached input>' cents per million
--                                  tokens, per price ('*': any other model)
--
-- Reply: status=ok|prices=<n>
-- Errors: LEDGER_VERSION, LEDGER_BADARG, LEDGER_CONFIG (window or bucket changed while
--         counters are kept).
-- Calls: HMGET, HKEYS, HDEL, HSET.

protocol_arg(ARGV[1])
local op = id_arg(ARGV[2], 'operation id')
local L = int_arg(ARGV[3], 'window ms', 1000, 400 * 86400000)
local G = int_arg(ARGV[4], 'bucket ms', 1000, L)
local hl = int_arg(ARGV[5], 'hold limit ms', 1, 86400000)
if L % G ~= 0 or L / G > 96 then
  fail('BADARG', 'bucket ms must divide the window into 1..96 buckets, got ' .. L .. ' / ' .. G)
end
local caps = {}
for k, f in ipairs({ 'c_i', 'c_o', 'c_c', 'c_t', 'c_$' }) do
  if ARGV[5 + k] ~= '-' then caps[#caps + 1], caps[#caps + 2] = f, int_arg(ARGV[5 + k], f, 0, 1e15) end
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
local was = redis.call('HMGET', hk, 'L', 'G', 'bl')
if was[3] and was[3] ~= '' and (tonumber(was[1]) ~= L or tonumber(was[2]) ~= G) then
  fail('CONFIG', 'the window and bucket of a scope with counters cannot change (' .. was[1] .. '/' .. was[2] .. ' ms)')
end
local old = {}
for _, f in ipairs(redis.call('HKEYS', hk)) do
  if string.sub(f, 1, 2) == 'p:' or string.sub(f, 1, 2) == 'c_' then old[#old + 1] = f end
end
if #old > 0 then redis.call('HDEL', hk, unpack(old)) end
local w = { 'L', L, 'G', G, 'hl', hl, 'k', counted == '-' and '' or counted, 'op', op }
for _, v in ipairs(caps) do w[#w + 1] = v end
for _, v in ipairs(prices) do w[#w + 1] = v end
redis.call('HSET', hk, unpack(w))
return reply({ 'status=ok', 'prices=' .. n })
