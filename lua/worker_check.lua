-- worker_check.lua: what an idle worker needs to know of one partition (read-only).
--
-- KEYS[1]  partition deadline index   '<prefix>:{p<N>}:deadlines'
-- KEYS[2]  partition job stream       '<prefix>:{p<N>}:jobs' (the same partition)
-- ARGV[1]  protocol version           the call's (docs/protocol.md#versions)
-- ARGV[2]  consumer group             [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[3]  idle ms                    0..2^31-1: a pending entry idle this long counts
--
-- Mode: read-only
-- Reply: due=<ms>|idle=<0|1>
--   due: ms until the partition's earliest lease deadline (0: passed), -1 when none;
--   idle: 1 when the group has an entry pending for at least ARGV[3] ms (to take over),
--   or when the stream or its group is missing (the worker's claim reports the loss).
-- Errors: LEDGER_BADARG, LEDGER_VERSION.
-- Calls: ZRANGEBYSCORE, TIME (only when a deadline exists), XPENDING.

local tag = string.match(KEYS[1] or '', '^([^{]*{p%d+}):deadlines$')
if not tag or KEYS[2] ~= tag .. ':jobs' or #KEYS ~= 2 then
  fail('BADARG', 'KEYS must be a partition\'s deadline index and job stream, got ' .. show(KEYS[2]))
end
protocol_arg(ARGV[1])
local group = id_arg(ARGV[2], 'consumer group')
local idle_ms = int_arg(ARGV[3], 'idle ms', 0, 2147483647)
local due = -1
local first = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
if first[2] then due = math.max(0, tonumber(first[2]) - now_ms()) end
local pending = redis.pcall('XPENDING', KEYS[2], group, 'IDLE', idle_ms, '-', '+', 1)
local idle = (pending.err or #pending > 0) and 1 or 0
return reply({ 'due=' .. string.format('%d', due), 'idle=' .. idle })
