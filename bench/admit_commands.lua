-- admit_commands.lua: the Redis commands of a single-item admit and nothing else, as a
-- benchmark reference (bench_core's phase admit_commands, bench_scale's admit phase).
-- Not a ledger operation.
--
-- The same HMGET (12 fields), outcome reads (two HMGET of a bucket and the epoch base),
-- TIME and HSETs (7 field/value pairs of the sizes admit writes, and one outcome
-- bucket) as ledger/lua/admit.lua for one new item, with constant values: no argument checks,
-- no arithmetic, no reply building. Its server time is what this data layout costs on
-- the machine before any of the ledger's Lua logic.
--
-- KEYS[1]  session hash (a scratch session of the benchmark)
-- KEYS[2]  outcome hash, KEYS[3] previous outcome hash (as admit gets them)
-- ARGV     the ARGV of a real single-item admit call: [1] op id, [6] item id
-- Reply:   the reply text of a single-item admit

local key, item = KEYS[1], 'i:r:' .. ARGV[6]
redis.call('HMGET', key, 'ep', 'tn', 'sq', 'fr', 'a_rm', 'F_rm', 'u_r', 'n_r', 'gz', 'xp', 'cd', item)
redis.call('HMGET', KEYS[2], 'ab', 'e')
redis.call('HMGET', KEYS[3], 'ab', 'e')
redis.call('TIME')
redis.call('HSET', key, item, '1|40|0|121', 'sq', '121', 'fr', '104779', 'a_rm', '121',
  'u_r', '121', 'n_r', '121')
redis.call('HSET', KEYS[2], 'ab', '\30' .. '0a1b2c3d4e5f60' .. '0a1b2c3d4e5f\001ok\0071\0081\0090\010\004104779\0050\00640')
return 'status=ok|charged=1|admitted=1|duplicates=0|skipped=|free=104779|epoch=1|turn=40'
