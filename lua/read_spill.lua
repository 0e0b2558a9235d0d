-- read_spill.lua: the content of a spilled tool result, while its spill TTL lasts
-- (read-only, no op id).
--
-- KEYS[1]  session hash            (only named: the session may have expired meanwhile)
-- KEYS[2]  spill hash              '<tag>:spill:<session>'
-- KEYS[3]  spill index             '<tag>:spilled:<session>'
-- ARGV[1]  protocol version        the call's (docs/protocol.md#versions)
-- ARGV[2]  tool-call id            [A-Za-z0-9._:/@+=#-]{1,128}
--
-- Mode: read-only
-- Reply: the content (bytes, as admit_tool stored it), or nil once its TTL has ended or when
--   nothing was spilled under that id.
-- Errors: LEDGER_BADARG, LEDGER_VERSION.
-- Calls: ZSCORE, TIME, HGET.

local call
protocol_arg(ARGV[1])
call = id_arg(ARGV[2], 'tool-call id')
if #ARGV ~= 2 then fail('BADARG', 'expected 2 arguments, got ' .. #ARGV) end
local tag, sid = string.match(KEYS[1] or '', '^([^{]*{p%d+}):s:(.+)$')
if not tag or KEYS[2] ~= tag .. ':spill:' .. sid or KEYS[3] ~= tag .. ':spilled:' .. sid or
    #KEYS ~= 3 then
  fail('BADARG', 'KEYS must be a session key, its spill hash and its spill index, got ' ..
    #KEYS .. ' keys: ' .. show(KEYS[2]))
end
local until_ms = tonumber(redis.call('ZSCORE', KEYS[3], call))
if not until_ms or until_ms <= now_ms() then return false end
return redis.call('HGET', KEYS[2], call)
