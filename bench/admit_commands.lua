-- admit_commands.lua: the Redis commands of a single-item admit and nothing else, as a
-- benchmark reference (bench_core's phase admit_commands). Not a ledger operation.
--
-- The same HMGET (14 fields), TIME and HSET (8 field/value pairs of the sizes admit
-- writes) as lua/admit.lua for one new item, with constant values: no argument checks,
-- no arithmetic, no outcome journal, no reply building. Its server time is what this
-- data layout costs on the machine before any of the ledger's Lua logic.
--
-- KEYS[1]  session hash (a scratch session of the benchmark)
-- ARGV     the ARGV of a real single-item admit call: [1] op id, [7] item id
-- Reply:   the reply text of a single-item admit

local key, item, outcome = KEYS[1], 'i:r:' .. ARGV[6], 'o:' .. ARGV[1]
redis.call('HMGET', key, 'ep', 'tn', 'sq', 'fr', 'a_m', 'F_m', 'u_r', 'n_r', 'gz', 'xp', 'cd',
  outcome, 'ol', item)
redis.call('TIME')
redis.call('HSET', key, item, '1|40|0|121', 'sq', '121', 'fr', '104779', 'a_m', '121',
  'u_r', '121', 'n_r', '121',
  outcome, '1764481234567|0a1b2c3d4e5f|status=ok|charged=1|admitted=1|duplicates=0|skipped='
    .. '|free=104779|epoch=1|turn=40',
  'ol', '3f9a0c1b2d4e5f6a7b8c1a,3f9a0c1b2d4e5f6a7b8c1b,3f9a0c1b2d4e5f6a7b8c1c')
return 'status=ok|charged=1|admitted=1|duplicates=0|skipped=|free=104779|epoch=1|turn=40'
