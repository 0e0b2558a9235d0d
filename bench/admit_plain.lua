-- admit_plain.lua: an unchecked admit of the kind users write by hand, as a benchmark
-- baseline (bench_scale's admit phase). Not a ledger operation: no op id, no epoch, no
-- idempotence, no argument checks, no floors, no reply beyond a number.
--
-- KEYS[1]  a session hash of the benchmark (a copy of the measured session)
-- KEYS[2]  an audit stream in the same hash slot
-- ARGV[1]  a request id   ARGV[2] item id   ARGV[3] tokens
-- Reply:   the free tokens left, or -1 when the item does not fit
-- Calls:   HMGET, two HINCRBY, XADD

local v = redis.call('HMGET', KEYS[1], 'fr', 'u_r', 'n_r')
local tokens = tonumber(ARGV[3])
if tonumber(v[1]) < tokens then return -1 end
redis.call('HINCRBY', KEYS[1], 'u_r', tokens)
local free = redis.call('HINCRBY', KEYS[1], 'fr', -tokens)
redis.call('XADD', KEYS[2], '*', 'req', ARGV[1], 'item', ARGV[2], 'tokens', ARGV[3])
return free
