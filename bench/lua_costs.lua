-- lua_costs.lua: what the pieces of a ledger script cost inside Redis's Lua, each run
-- N times in one call (benchmark only, python -m bench.lua_costs). Not a ledger operation.
--
-- KEYS[1]  a scratch hash in Redis's hashtable encoding (the hot path of a live session)
-- KEYS[2]  a scratch hash of 300 short fields, still a listpack (a fresh session's kind)
-- ARGV[1]  piece name (below)        ARGV[2]  N, iterations
-- ARGV[3]  a 22-character op id      ARGV[4]  a decimal integer argument
-- Reply:   N

local ht, lp = KEYS[1], KEYS[2]
local name, n, op, num = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local pieces = {
  empty = function() end,
  ['number to string (..)'] = function(i) local _ = 'a' .. i end,
  ['number to string (%d)'] = function(i) local _ = string.format('%d', i) end,
  ['13-digit number (..)'] = function(i) local _ = 'a' .. (1764481234567 + i) end,
  ['tonumber'] = function() local _ = tonumber(num) end,
  ['checked integer argument'] = function()
    local _ = #num <= 16 and string.match(num, '^%-?%d+$') and tonumber(num)
  end,
  ['checked identifier argument'] = function()
    local _ = #op <= 128 and string.find(op, '^[%w%._:/@%+=#%-]+$')
  end,
  ['table of 13 strings'] = function()
    local _ = { 'ep', 'tn', 'sq', 'fr', 'a', 'b', 'c', 'd', 'gz', 'xp', 'cd', 'o' }
  end,
  ['reply of 17 parts'] = function()
    local _ = table.concat({ 'status=ok|charged=', 1, '|admitted=', 1, '|duplicates=', 0,
      '|skipped=', '', '|free=', 12345, '|epoch=', 1, '|turn=', 40 })
  end,
  ['closure'] = function() local function f() return 1 end return f end,
  -- what ledger/scripts.py wraps every script in, around an empty body
  ['error wrapper (xpcall)'] = function()
    local ok, out = xpcall(function() return 1 end, function(e) return e end)
    if ok then return out end
  end,
  ['TIME'] = function() redis.call('TIME') end,
  ['HGET, field present'] = function() redis.call('HGET', ht, 'f7') end,
  ['HGET, field missing'] = function() redis.call('HGET', ht, 'nope') end,
  ['HGET missing, 300-field listpack'] = function() redis.call('HGET', lp, 'nope') end,
  ['HMGET of 14 fields'] = function()
    redis.call('HMGET', ht, 'f1', 'f2', 'f3', 'f4', 'f5', 'f6', 'f7', 'f8', 'f9', 'f10', 'f11',
      'f12', 'f13', 'f14')
  end,
  ['HSET 1 field, string value'] = function() redis.call('HSET', ht, 'f7', '7') end,
  ['HSET 1 field, number value'] = function(i) redis.call('HSET', ht, 'f7', i) end,
  ['HSET 8 fields'] = function()
    redis.call('HSET', ht, 'f1', '1', 'f2', '2', 'f3', '3', 'f4', '4', 'f5', '5', 'f6', '6',
      'f7', '7', 'f8', '8')
  end,
}
local f = pieces[name]
if not f then return redis.error_reply('unknown piece ' .. tostring(name)) end
for i = 1, n do f(i) end
return n
