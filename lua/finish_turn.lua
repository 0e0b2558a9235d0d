-- finish_turn.lua: the end of a two-call turn (docs/protocol.md#a-turn-in-two-calls): the
-- turn's tool results admitted whole, then the turn ended and committed with the real
-- prompt, as end_turn ends it, in one step.
--
-- Every tool result must go in whole, without evicting memory: each is held already at
-- its whole size (a retry, another worker: charged nothing) or new, and the new ones
-- together fit in the free room. Otherwise nothing is admitted and the turn is not ended
-- (status=refused, reason=not_whole, the first result that does not go in whole as item=):
-- the caller admits them one by one with admit_tool (which may spill them) and ends the
-- turn with end_turn. The prompt given counts every tool result whole. A hard reset staged
-- while the turn was open applies after the turn's commit, as at end_turn (reset=).
--
-- KEYS[1]  session hash
-- KEYS[2]  partition job stream    a compaction job is appended when one becomes pending
-- KEYS[3]  partition deadline index  the turn lease's member '<session>|~' is removed
-- KEYS[4]  content store           '<tag>:content:<session>'
-- KEYS[5]  summaries               '<tag>:compacted:<session>' (deleted by a staged reset)
-- KEYS[6]  (optional) reclaim-order index  '<tag>:order:<session>' (see ORDER in _common.lua)
-- KEYS[-3] partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[-2] outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[-1] previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch@turn!token        the open turn's stamp (see `fence`)
-- ARGV[3]  turn                    the open turn (as begin_turn returned it), 1..1e15
-- ARGV[4]  final prompt tokens     the prompt actually sent, counting the tool results
--                                  whole, 1..1e8
-- ARGV[5]  p99 trend               -1..1: -1 falling, 0 flat or unknown, 1 rising
-- ARGV[6]  session id              must name KEYS[1]
-- ARGV[7]  commit mark             an id, or '-' to keep the last
-- ARGV[8]  keep text               1: each new result's content goes to the content store
--                                  ('s:<call id>'), 0: not
-- ARGV[9]  n                       tool results, 0..64
-- ARGV[10..9+3n]  n triples  tool-call id, tokens (1..1e8), content (bytes,
--                                  at most 64 MiB in all)
--
-- KEYS count: 8; 9 with the order index
-- Mode: mutating
-- Reply: end_turn's reply (its reset= too), then |tools=<charged>;<id>,...|free=<tokens>
--    or  status=refused|reason=not_whole|item=<id>|requested=<tokens>|free=<tokens>
--          |epoch=<n>|turn=<n>
-- Errors: LEDGER_BADARG, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED, LEDGER_TURNHELD,
--         LEDGER_TURNLOST (the turn is not open).
-- Calls: HMGET, TIME, HSET, HDEL, ZREM, HINCRBY (class; x:drift when flagged), HGET and
--        XADD when a compaction becomes pending; ZADD of the reclaim-order index when
--        sent, its PEXPIRE when due; HSET and PEXPIRE of the content store with keep text;
--        the outcome store's HMGET and HSET; with a staged reset HEXISTS, HGETALL, HDEL,
--        ZREM, HINCRBY, DEL and HSET (see `reset_effect`).

local op, fp, epoch = op_args('finish_turn', false)
local turn, final, trend
turn = int_arg(ARGV[3], 'turn', 1, 1e15)
final = int_arg(ARGV[4], 'final prompt tokens', 1, TOKENS_MAX)
trend = int_arg(ARGV[5], 'p99 trend', -1, 1)
local sid, mark
sid = session_arg(ARGV[6])
mark = ARGV[7] == '-' and '-' or id_arg(ARGV[7], 'commit mark')
if ARGV[8] ~= '0' and ARGV[8] ~= '1' then
  fail('BADARG', 'keep text must be 0 or 1, got ' .. show(ARGV[8]))
end
local n
n = int_arg(ARGV[9], 'tool result count', 0, 64)
if #ARGV ~= 9 + 3 * n then
  fail('BADARG', 'expected ' .. (9 + 3 * n) .. ' arguments for ' .. n .. ' tool results, got ' .. #ARGV)
end
local ids, toks, seen, bytes = {}, {}, {}, 0
local fields = { 'ep', 'tn', 'W', 'S', 'T', 'a_w', 'a_rm', 'a_s', 'F_w', 'HW', 'cd', 'kt', 'rut', 'rup',
  'ai', 'an', 'pu', 'ams', 'amf', 'amp', 'gz', 'xp', 'te', 'dt', 'fr', 'sq', 'u_s', 'n_s', 'ttl', 'ort',
  'lo', 'oq', 'ox', 'uo', 'rz' }
local NNUM = 30  -- (ttl and ort: for the content store's TTL and the commit, not read again)
for k = 1, n do
  local b = 7 + 3 * k
  local id
  id = id_arg(ARGV[b], 'tool-call id')
  if seen[id] then fail('BADARG', 'tool-call id ' .. id .. ' appears twice') end
  seen[id] = true
  ids[k], toks[k] = id, int_arg(ARGV[b + 1], 'tokens', 1, TOKENS_MAX, id)
  bytes = bytes + #ARGV[b + 2]
  fields[#fields + 1] = 'i:s:' .. id
end
if bytes > 67108864 then fail('BADARG', 'the tool results\' content must be at most 64 MiB') end

local ORD = #KEYS == 9 and KEYS[6] or nil
if ORD then
  key_arg(2, 'jobs', 'deadlines', 'content:%s', 'compacted:%s', 'order:%s')
else
  key_arg(2, 'jobs', 'deadlines', 'content:%s', 'compacted:%s')
end
local key = KEYS[1]
local H, R = load(key, fields, NNUM)
local again = gate(recorded(op), H.ep, op, fp, epoch)
if again then return again end
fence(key, R[1], H.tn, turn)
local now = now_ms()

-- The tool results: each held whole already, or new and all of them fitting.
local add, want, short = {}, 0, nil
for k = 1, n do
  local held = R[5 + k]
  if held then
    if tonumber(string.match(held, '^(%d+)|')) < toks[k] and not short then short = ids[k] end
  else
    add[#add + 1] = k
    want = want + toks[k]
  end
end
if not short and want > H.fr then short = ids[add[1]] end
if short then
  indicate(key, 'refused', 1)
  return commit(key, now, op, fp, table.concat({ 'status=refused|reason=not_whole|item=', short,
    '|requested=', want, '|free=', H.fr, '|epoch=', H.ep, '|turn=', H.tn }), {},
    { gz = H.gz, xp = H.xp, uo = R[4] or '' })
end
local f = string.format
local args, done, stored, z = {}, {}, {}, nil
local sq, a_s, fr = H.sq, H.a_s + want, H.fr - want
if #add > 0 then
  z = ORD and {} or nil
  for _, k in ipairs(add) do
    sq = sq + 1
    local field = fields[NNUM + 5 + k]
    args[#args + 1], args[#args + 2] = field, f('%d|%d|0|%d', toks[k], H.tn, sq)
    if z then z[#z + 1], z[#z + 2] = order_score('s', sq), field end
    if ARGV[8] == '1' then stored[#stored + 1], stored[#stored + 2] = 's:' .. ids[k], ARGV[9 + 3 * k] end
  end
  for _, kv in ipairs({ 'sq', f('%d', sq), 'fr', f('%d', fr), 'a_s', f('%d', a_s),
      'u_s', f('%d', H.u_s + want), 'n_s', f('%d', H.n_s + #add) }) do
    args[#args + 1] = kv
  end
  order_keep(ORD, 's', R[2], f('%d', H.sq), f('%d', sq), z, R[3], now, key, args)
end
local J = { gz = H.gz, xp = H.xp, ttl = H.ttl, ort = H.ort }
put(KEYS[4], stored, J, key)
local charged = {}
for k = 1, n do charged[k] = (R[5 + k] and '0;' or toks[k] .. ';') .. ids[k] end

-- The end of the turn, as end_turn.lua judges it.
local out = turn_end(key, H, a_s, final, trend, turn, mark, sid, op, args)
local st = reset_staged(R[5], H.ep)
for _, v in ipairs({ '|reset=', st and (H.ep + 1) or '', '|tools=', table.concat(charged, ','),
    '|free=', fr }) do
  out[#out + 1] = v
end
local reply = table.concat(out)
commit(key, now, op, fp, reply, args, J)
reset_at_end(key, st, { KEYS[3], KEYS[4], KEYS[5] }, sid)
return reply
