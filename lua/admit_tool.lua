-- admit_tool.lua: admit one tool result whole, spill it, or refuse it
-- (the admission-with-spill rule, docs/rules.md#admission-with-spill).
--
-- Never truncated. In order:
--   1. it fits: admitted whole as a scratchpad item;
--   2. it fits once memory (retrieval, recall: the only elastic consumers) gives
--      way: memory items are evicted, lowest priority then oldest, retrieval
--      before recall, and the result is admitted whole;
--   3. otherwise its content is stored in the session's spill hash under its call id
--      (readable by any worker until the spill TTL) and a bounded preview (the budget's spill preview, at
--      most the result's size) is admitted in its place, evicting memory if needed;
--   4. otherwise it is refused.
-- The system prompt, the framing and the floors are never touched. Parallel
-- results of one turn are judged one after another, so two that fit alone but not
-- together get one admitted and the other spilled or refused.
--
-- KEYS[1]  session hash
-- KEYS[2]  content store           '<tag>:content:<session>'
-- KEYS[3]  spill hash              '<tag>:spill:<session>': call id -> spilled content
-- KEYS[4]  spill index             '<tag>:spilled:<session>': sorted set of call ids, scored
--                                  by the end of their spill TTL (ms, Redis's clock)
-- KEYS[5]  (optional) reclaim-order index  '<tag>:order:<session>': kept when sent (see
--          ORDER in _common.lua)
-- KEYS[-3] partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[-2] outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[-1] previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch[@turn]             integer; older than the session's -> LEDGER_STALE; @turn:
--                                  a call of that turn (see `fence`)
-- ARGV[3]  tool-call id            the scratchpad item id
-- ARGV[4]  tokens                  the whole result's size, 1..1e8
-- ARGV[5]  content                 the result (bytes, at most 64 MiB), stored only when spilled
-- ARGV[6]  keep text               1: the result, admitted or spilled, also gets its content
--                                  in the content store ('s:<call id>', what a compactor
--                                  summarizes), 0: not
--
-- A spill stores the content in KEYS[3], its TTL's end in KEYS[4], removes the results
-- whose TTL has ended from both, and gives both keys the spill TTL.
--
-- KEYS count: 7; 8 with the order index
-- Mode: mutating
-- Reply: status=ok|outcome=<admitted|spilled|duplicate>|item=<id>|charged=<tokens>
--          (duplicate: already held; preview is the held preview when it was spilled, else 0)
--          |tokens=<tokens>|preview=<tokens>|evicted=<c:id,...>|free=<tokens>|epoch=<n>|turn=<n>
--    or  status=refused|reason=<token_budget_exhausted|floor_protected>|requested=<tokens>
--          |free=<tokens>|epoch=<n>|turn=<n>
-- Errors: LEDGER_BADARG, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED, LEDGER_TURNHELD,
--         LEDGER_TURNLOST (see `fence` in _common.lua).
-- Calls: HMGET, TIME, HSET (ZADD of the reclaim-order index when sent, HGET of ttl and its
--        PEXPIRE when due, and its ZREM and EXISTS when memory gives way; HGETALL and HDEL when memory gives way; ZRANGEBYSCORE, HDEL,
--        ZREM, HSET, ZADD and PEXPIRE when spilled; HSET and PEXPIRE with keep text).

local op, fp, epoch, tok = op_args('admit_tool', false)
local call, tokens
call = id_arg(ARGV[3], 'tool-call id')
tokens = int_arg(ARGV[4], 'tokens', 1, TOKENS_MAX)
if type(ARGV[5]) ~= 'string' or #ARGV[5] > 67108864 then
  fail('BADARG', 'content must be at most 64 MiB')
end
if ARGV[6] ~= '0' and ARGV[6] ~= '1' then
  fail('BADARG', 'keep text must be 0 or 1, got ' .. show(ARGV[6]))
end
if #ARGV ~= 6 then fail('BADARG', 'expected 6 arguments, got ' .. #ARGV) end

local ORD = #KEYS == 8 and KEYS[5] or nil
if ORD then
  key_arg(2, 'content:%s', 'spill:%s', 'spilled:%s', 'order:%s')
else
  key_arg(2, 'content:%s', 'spill:%s', 'spilled:%s')
end
local key = KEYS[1]
local H, R = load(key, { 'ep', 'tn', 'sq', 'fr', 'F_rm', 'a_rm', 'a_s', 'u_r', 'u_m', 'u_s', 'n_r', 'n_m', 'n_s',
  'pv', 'sttl', 'gz', 'xp', 'oq', 'ox', 'i:s:' .. call, 'lo', 'ul', 'uo' }, 19)
local again = gate(recorded(op), H.ep, op, fp, epoch)
if again then return again end
local in_turn = fence(key, R[2], H.tn, tok)
local now = now_ms()
local J = { gz = H.gz, xp = H.xp, uo = in_turn and (R[4] or '') or nil }
local function done(outcome, charged, preview, evicted, fr, args)
  return commit(key, now, op, fp, table.concat({ 'status=ok|outcome=', outcome, '|item=', call,
    '|charged=', charged, '|tokens=', tokens, '|preview=', preview, '|evicted=', evicted,
    '|free=', fr, '|epoch=', H.ep, '|turn=', H.tn }), args, J)
end
if R[1] then
  -- Held already (a retry, another worker): a held size below the result's means it
  -- was spilled, and that preview is what the prompt may show.
  local held = tonumber(string.match(R[1], '^(%d+)|'))
  return done('duplicate', 0, held < tokens and held or 0, '', H.fr, {})
end

-- Tokens memory can give back: its claim above its floor, items only (not reservations).
local held = H.u_r + H.u_m
-- rule: system-prompt-floor (memory alone gives way, never the system prompt; the demo's rule tests add to the next line)
local gain = math.max(H.a_rm, H.F_rm) - math.max(H.a_rm - held, H.F_rm)
local size, outcome = tokens, 'admitted'
-- rule: spill (the demo's rule tests replace the next line)
if tokens > H.fr + gain then size, outcome = math.min(tokens, H.pv), 'spilled' end
if size > H.fr + gain then
  indicate(key, 'refused', 1)
  return commit(key, now, op, fp, table.concat({ 'status=refused|reason=', refusal_reason(key, size),
    '|requested=', tokens, '|free=', H.fr, '|epoch=', H.ep, '|turn=', H.tn }), {}, J)
end

local fr, a_rm, evicted, ul, emptied = H.fr, H.a_rm, {}, nil, false
local U, N = { r = H.u_r, m = H.u_m }, { r = H.n_r, m = H.n_m }
if size > fr then
  local mem = {}
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local c, id = string.match(all[i], '^i:([rm]):(.+)$')
    if c then
      local t, _, p, sq = string.match(all[i + 1], '^(%d+)|(%d+)|(%d+)|(%d+)$')
      mem[#mem + 1] = { c = c, id = id, f = all[i], v = all[i + 1], t = tonumber(t), p = tonumber(p),
        sq = tonumber(sq) }
    end
  end
  table.sort(mem, function(x, y)
    if x.c ~= y.c then return x.c == 'r' end
    if x.p ~= y.p then return x.p < y.p end
    return x.sq < y.sq
  end)
  local dead, was = {}, {}
  for _, it in ipairs(mem) do
    if size <= fr then break end
    was[#dead + 1] = it.v
    fr = fr - claim_delta(a_rm, -it.t, H.F_rm)
    a_rm = a_rm - it.t
    U[it.c], N[it.c] = U[it.c] - it.t, N[it.c] - 1
    dead[#dead + 1] = it.f
    evicted[#evicted + 1] = it.c .. ':' .. it.id
  end
  call_each('HDEL', key, dead)
  emptied = ORD ~= nil and order_remove(ORD, dead)
  indicate(key, 'evicted_memory', #dead)
  if in_turn then ul = journal(R[3], dead, was) end
end
if outcome == 'spilled' then
  local past = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, 256)
  if #past > 0 then  -- (at most 256 a call: each spill removes more than it adds)
    redis.call('HDEL', KEYS[3], unpack(past))
    redis.call('ZREM', KEYS[4], unpack(past))
  end
  redis.call('HSET', KEYS[3], call, ARGV[5])
  redis.call('ZADD', KEYS[4], now + H.sttl, call)
  redis.call('PEXPIRE', KEYS[3], H.sttl)
  redis.call('PEXPIRE', KEYS[4], H.sttl)
  indicate(key, 'spilled', 1)
end
if ARGV[6] == '1' then
  put(KEYS[2], { 's:' .. call, ARGV[5] }, J, key)
end
local sq = H.sq + 1
fr = fr - size
local args = { 'i:s:' .. call, table.concat({ size, H.tn, 0, sq }, '|'), 'sq', sq, 'fr', fr, 'a_rm', a_rm,
  'a_s', H.a_s + size, 'u_s', H.u_s + size, 'n_s', H.n_s + 1, 'u_r', U.r, 'u_m', U.m,
  'n_r', N.r, 'n_m', N.m }
if ul then args[#args + 1], args[#args + 2] = 'ul', ul end
-- (an index the eviction emptied gets its TTL again from the add, or from the next one)
if not order_keep(ORD, 's', H.oq, H.sq, sq, { order_score('s', sq), args[1] },
    not emptied and H.ox or nil, now, key, args) and emptied then
  args[#args + 1], args[#args + 2] = 'ox', 0
end
return done(outcome, size, outcome == 'spilled' and size or 0, table.concat(evicted, ','), fr, args)
