-- begin_turn.lua: take the session's turn lease, gate the turn on residual working
-- memory against its declared working set (docs/rules.md#working-memory-starvation),
-- reclaiming scratchpad then earlier retrieval when short, and advance the turn.
--
-- KEYS[1]  session hash
-- KEYS[2]  partition job stream    a compaction job is appended when one becomes pending
--                                  (worker-owned sessions only)
-- KEYS[3]  partition deadline index  the turn lease's member '<session>|~' (score: its end)
-- KEYS[4]  partition tally         '<tag>:tally': the fleet's indicators (see `indicate`)
-- KEYS[5]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[6]  previous outcome hash   previous generation ('<tag>:old:<session>')
--          Optional keys between KEYS[3] and the tally, in this order, each told apart by
--          its name: the session's summaries hash '<tag>:compacted:<session>' (its field
--          '~' is '<worker>|<until ms>' while a worker computes the compaction; needed with
--          ARGV[9] 1), its content store '<tag>:content:<session>' (with the summaries
--          hash: a staged compaction lands), the reclaim-order index '<tag>:order:<session>'
--          (see ORDER in _common.lua): 6 to 9 KEYS.
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  v:epoch!token           '<version>:<epoch>!<owner token>' (op_args): the token
--                                  of the turn, required (its SHA-1 is stored as lk);
--                                  an older epoch -> LEDGER_STALE
-- ARGV[3]  working set             tokens the turn must hold in working memory, 0..1e8
-- ARGV[4]  output reserve          tokens for this turn's output, 0..1e8, or '-' for the budget's
-- ARGV[5]  session id              must name KEYS[1]
-- ARGV[6]  owner                   who serves the turn, [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[7]  lease                   milliseconds the turn is held without a renewal, 1..86400000
-- ARGV[8]  takeover                0..1; 1: take a live turn over (roll it back), 0: refuse
-- ARGV[9]  (optional) await         0..1; 1: refuse the turn while a compaction is pending and
--                                  none is staged to land with this call (LEDGER_COMPACTING,
--                                  nothing changed), so that the caller waits for it to land
--                                  first; needs the summaries hash. 0 or absent: begin
--                                  whatever is pending
--
-- A staged compaction (field kp, see compact.lua) lands when the summaries hash and the
-- content store are sent: after the open turn is ended or rolled back, before this turn is
-- gated, judged as compact.lua judges one (`compaction_effect`) but strictly: a replaced
-- item no longer held at the version the compactor read, or the summary id held and not
-- replaced, makes it stale (nothing replaced, a failed compaction, retried by a new job).
-- A plan of another epoch is dropped. Its deliveries go to this turn.
--
-- A staged hard reset (field rz, see reset.lua) applies with the same two keys, once no
-- turn is open: when none was, or once this call ended the open turn or rolled it back
-- (not when it refuses the turn for another owner's live one), before a staged compaction
-- lands (then of another epoch: dropped) and before this turn is gated; the turn begins at
-- the new epoch (reset=<it>, and epoch=), with nothing held and nothing to deliver.
--
-- The turn lease (docs/agent.md#turn-leases). While a turn is open another owner's
-- begin_turn is refused (LEDGER_TURNHELD, nothing changed) unless it takes over; a
-- turn whose lease has lapsed, or one taken over, is rolled back first (see `rollback`
-- in _common.lua). The same owner beginning again ends its open turn as it stands (no
-- report), unless this turn is refused: that one then goes on. The turn gets the deliveries queued since the last turn: the summaries of
-- compactions committed outside a turn and the items they replaced.
--
-- Residual working memory = window - system prompt - tool framing - output reserve
-- - memory's claim - scratchpad; the turn needs max(working set, working memory's
-- own claim). Consumers configured as released each turn lose their items first.
-- When short: the regime is starvation (utilization under the eviction threshold)
-- or loud (above it); scratchpad items are reclaimed oldest first, then retrieval
-- chunks from earlier turns (those also held by recall first, then oldest), then
-- recall items, oldest first (all recoverable by re-invocation or re-query). The
-- plan is applied only if it closes the gap; otherwise nothing is reclaimed, a
-- compaction is requested, and the turn is refused.
--
-- KEYS count: 7, 8 or 9: the summaries hash, the content store and the order index are each optional (six keys without them)
-- Mode: mutating
-- Reply: status=ok|regime=<ok|starvation|loud>|turn=<n>|residual=<tokens>|need=<tokens>
--          |utilization=<per mille>|reclaimed=<c:id,...>|rotated=<tokens>|released=<tokens>
--          |compaction_due=<0|1>|rollup=<0|1>|free=<tokens>|epoch=<n>|summaries=<id,...>
--          |dropped=<c:id,...>|lease=<ms>|rolled_back=<turn or 0>|mark=<commit mark>
--          |landed=<compacted|failed|deferred|did_not_fit|stale, or empty: none landed>
--          |reset=<new epoch, or empty: no staged reset applied>
--   summaries, dropped: the deliveries (the app adds the summaries to its state and drops
--   the items, as it drops those reclaimed); lease: when the lease ends (Redis's clock);
--   rolled_back: the turn undone to start this one; mark: the last end_turn's mark.
--    or  status=refused|reason=<starvation|compaction_pending>|requested=<need>|residual=<tokens>
--          |need=<tokens>|utilization=<per mille>|shortfall=<tokens>|compact=<w:id,...>
--          |free=<tokens>|epoch=<n>|turn=<n>|rolled_back=<turn or 0>|reset=<new epoch, or empty>
--   (no lease is taken; a turn rolled back to try stays rolled back, its deliveries queued,
--   a staged compaction landed stays landed, and a staged reset applied stays applied)
--   compact: working-memory items to compact, lowest priority then oldest first,
--   enough to cover the shortfall where compacting working memory can cover it
--   (docs/rules.md#working-memory-practice); empty when the declared working set
--   cannot fit at all.
-- Errors: LEDGER_BADARG, LEDGER_CONFIG (the output reserve makes the reserved floor
--         exceed the window), LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED,
--         LEDGER_TURNHELD (another owner's turn is open and its lease live),
--         LEDGER_COMPACTING (with ARGV[9] 1, a compaction is pending: 'compaction pending,
--         computed by <worker> until <ms>' or 'compaction pending, not picked up'; checked
--         after the replay, the epoch and the budget, before the turn lease).
-- Calls: HMGET, TIME, HSET, ZADD, HDEL (HGETALL and the rollback's writes to roll a turn back; HGET when a compaction becomes pending; HSCAN and HDEL only to rotate or reclaim (HSCAN of working memory too on a refusal); with the
--        reclaim-order index, ZSCORE, ZCARD, ZRANGEBYSCORE, HMGET and ZREM instead of HSCAN for
--        scratchpad, retrieval and recall, and ZADD, ZREMRANGEBYSCORE, HSCAN, HGET and PEXPIRE to build it again; HINCRBY; XADD when a
--        compaction becomes pending)
--        and HMGET of the op's outcome bucket and the epoch base e, HSET of the bucket; a PEXPIRE, or the outcome generations' RENAME and PEXPIRE, when due;
--        with a staged reset HGETALL, HDEL, ZREM, HINCRBY, DEL and HSET (see `reset_effect`).

local op, fp, epoch = op_args('begin_turn', false)
if not CALL_TOKEN then
  fail('BADARG', 'begin_turn needs the owner token of the turn: ARGV[2] <version>:<epoch>!<token>')
end
local ws, out2
ws = int_arg(ARGV[3], 'working set', 0, TOKENS_MAX)
if ARGV[4] ~= '-' then
  out2 = int_arg(ARGV[4], 'output reserve', 0, TOKENS_MAX)
end
local sid, owner, lease, takeover
sid = session_arg(ARGV[5])
owner = id_arg(ARGV[6], 'turn owner')
lease = int_arg(ARGV[7], 'lease ms', 1, 86400000)
takeover = int_arg(ARGV[8], 'takeover', 0, 1)
local await = #ARGV == 9 and int_arg(ARGV[9], 'await', 0, 1) or 0
if #ARGV ~= 8 and #ARGV ~= 9 then fail('BADARG', 'expected 8 or 9 arguments, got ' .. #ARGV) end

-- 6 keys, and after KEYS[3] the optional ones in this order, each told apart by its name:
-- the summaries hash, the content store, the reclaim-order index.
local SUMS, CONTENT, ORD
local named, at = { 'jobs', 'deadlines' }, 4
for _, suffix in ipairs({ 'compacted:%s', 'content:%s', 'order:%s' }) do
  if at <= #KEYS - 3 and is_key(at, suffix) then
    named[#named + 1] = suffix
    if suffix == 'compacted:%s' then SUMS = KEYS[at] elseif suffix == 'content:%s' then
      CONTENT = KEYS[at] else ORD = KEYS[at] end
    at = at + 1
  end
end
key_arg(2, unpack(named))
if await == 1 and not SUMS then
  fail('BADARG', 'await 1 needs the summaries hash as KEYS[4], got ' .. #KEYS .. ' keys')
end
local key = KEYS[1]
local FIELDS = { 'ep', 'tn', 'W', 'S', 'T', 'R0', 'F_w', 'F_rm', 'a_w', 'a_rm', 'a_s', 'u_w', 'u_r',
  'u_m', 'u_s', 'n_w', 'n_r', 'n_m', 'n_s', 'EV', 'HW', 'kt', 'rut', 'rup', 'cd', 'gz', 'xp', 'fr',
  'out', 'le', 'pm', 'rel', 'lo', 'qs', 'qd', 'cm', 'kp', 'rz' }
local H, R = load(key, FIELDS, 31)
local again = gate(recorded(op), H.ep, op, fp, epoch)
if again then return again end
out2 = out2 or H.R0
local floor = reserved_floor(H, out2)
if floor > H.W then
  fail('CONFIG', 'output reserve ' .. out2 .. ' makes the reserved floor ' .. floor ..
    ' exceed the window ' .. H.W)
end
local now = now_ms()
-- A staged compaction lands with this call (below), when it is sent the summaries hash and
-- the content store the compaction writes.
local lands = R[6] and SUMS and CONTENT
-- A staged reset applies with this call unless it refuses the turn for another owner's
-- live one (below): the open turn, if any, ends with this call.
local mine = R[2] == owner and owns(redis.call('HGET', key, 'lk'))
local implicit = mine and H.le > now and takeover == 0
local st = SUMS and CONTENT and reset_staged(R[7], H.ep)
if st and R[2] and not implicit and H.le > now and takeover == 0 then st = nil end
-- A pending compaction lands only between turns: a caller that waits for it is told so
-- (and whether a worker computes it now), and nothing changes. This is the compaction
-- charged before the turn's admissions (docs/rules.md#compaction-credit): the turn whose
-- retrieval it makes room for begins after it, not against it.
-- rule: pending-compaction-credit (the demo's rule tests replace the next line)
if await == 1 and H.cd == 1 and not lands and not st then
  local who, till = string.match(redis.call('HGET', SUMS, '~') or '', '^(.*)|(%d+)$')
  if till and tonumber(till) > now then
    fail('COMPACTING', 'compaction pending, computed by ' .. who .. ' until ' .. till)
  end
  local asked = tonumber(redis.call('HGET', key, 'cq') or '')
  if asked then
    fail('COMPACTING', 'compaction pending, not picked up, requested ' ..
      string.format('%d', math.max(now - asked, 0)) .. ' ms ago')
  end
  fail('COMPACTING', 'compaction pending, not picked up')
end
-- The same owner beginning again while its lease is live ends its open turn as it
-- stands (implicit): the same owner is the same name and the open turn's owner token
-- (a name is no secret: snapshot() shows it). A lapsed lease, or a takeover, rolls the
-- open turn back, whoever owned it (a process restarted under the same owner name is not
-- the one that died); else the call is refused.
local rolled = 0
if R[2] and not implicit then
  if H.le > now and takeover == 0 then
    if R[2] == owner then turn_held(key, R[2], H.tn, NOT_OWNER) end
    turn_held(key, R[2], H.tn)
  else
    rolled = rollback(key, KEYS[3], sid, H.le > now and ('taken over by ' .. owner) or
      ('lease of ' .. R[2] .. ' lapsed'))
    H, R = load(key, FIELDS, 31)
  end
end
-- The staged reset applies now, the open turn ended (implicit) or rolled back.
local reset_to = ''
if st then
  local args = {}
  reset_to = reset_effect(key, { KEYS[3], CONTENT, SUMS }, sid, st.reason, args)
  call_each('HSET', key, args)
  H, R = load(key, FIELDS, 31)
end
-- The staged compaction (a worker's, committed while the last turn was open) lands now,
-- at the turn boundary, before this turn is gated: judged as compact.lua judges one, on
-- the items as they are now (each still held at the version the compactor read, else the
-- plan is stale: nothing replaced, a failed compaction), its post-condition on what is
-- left of the history it read. A plan of another epoch (a reset came between) is dropped.
local landed = ''
if lands then
  redis.call('HDEL', key, 'kp')
  local fine, P = pcall(cjson.decode, R[6])
  if fine and type(P) == 'table' and tonumber(P.ep) == H.ep then
    local list = type(P.items) == 'table' and P.items or {}
    local refs, sum_id = plan_refs(list), P.id
    local fields = { 'i:w:' .. sum_id }
    for i = #COMPACT_NUM, 1, -1 do table.insert(fields, 1, COMPACT_NUM[i]) end
    for k = 1, #refs do fields[#fields + 1] = 'i:' .. refs[k].ref end
    local C, CR = load(key, fields, #COMPACT_NUM)
    local recs = {}
    for k = 1, #refs do recs[k] = CR[1 + k] end
    local matched = plan_matched(refs, recs)
    local replaces = false
    for k = 1, #refs do if refs[k].ref == 'w:' .. sum_id and matched[k] then replaces = true end end
    local args, V = compaction_effect(key, C, recs, matched, { refs = refs, sum_id = sum_id,
      sum_t = tonumber(P.t), text = P.text ~= '' and P.text or nil, read = tonumber(P.read),
      strict = true, conflict = CR[1] and not replaces, qs = R[3], qd = R[4], job = true, sid = sid,
      op = P.op, now = now, J = { gz = H.gz, xp = H.xp } },
      { jobs = KEYS[2], content = CONTENT, sums = SUMS })
    call_each('HSET', key, args)
    landed = V.outcome
    H, R = load(key, FIELDS, 31)
  end
end
local queued_s, queued_d = R[3] or '', R[4] or ''

local A = { a_w = H.a_w, a_rm = H.a_rm, a_s = H.a_s }
local U = { w = H.u_w, r = H.u_r, m = H.u_m, s = H.u_s }
local N = { w = H.n_w, r = H.n_r, m = H.n_m, s = H.n_s }
local dead, dead_rec, released, rotated, reclaimed, gone = {}, {}, 0, 0, {}, {}
local function drop(c, it)
  local g = ACTIVE[c]  -- (its group's field)
  A[g], U[c], N[c] = A[g] - it.t, U[c] - it.t, N[c] - 1
  dead[#dead + 1] = it.f
  dead_rec[#dead] = it.v
  gone[it.f] = true
  return it.t
end
-- (working memory's residual: the free room were working memory to hold nothing, its
-- floor included; free_room with no working memory takes its floor F_w, given back here)
local function residual() return free_room(H, out2, 0, A.a_rm, A.a_s) + H.F_w end
local function need() return math.max(ws, A.a_w, H.F_w) end
local function occupancy() return H.S + H.T + A.a_w + A.a_rm + A.a_s end

-- The items, read only when a turn must rotate or reclaim (a turn that is already ok
-- costs no read of them), one consumer at a time as the turn reaches it, oldest first.
-- Scratchpad, retrieval and recall come from the reclaim-order index when it is sent
-- (ORDER in _common.lua): a page of members at a time, each looked up in the session
-- (a member whose item is gone is skipped, and removed), so that the turn reads about
-- the items it reclaims, whatever else the session holds. Working memory (read only to
-- rotate it or to name what to compact on a refusal), and every consumer when the index
-- is not sent, come from HSCAN with MATCH 'i:<code>:*', which picks a consumer's fields
-- out in C but walks every field of the hash.
local rotating = R[1] and R[1] ~= '-'
local oq, stale = nil, {}  -- (the index's writes: its 'oq' once built, members found stale)
local function parse(f, rec)
  local t, tn, p, sq = string.match(rec, '^(%d+)|(%d+)|(%d+)|(%d+)$')
  return { id = string.sub(f, 5), f = f, v = rec, t = tonumber(t), tn = tonumber(tn),
    p = tonumber(p), sq = tonumber(sq) }
end
local items, each_item  -- (made only for a turn that must rotate or reclaim)
if rotating or residual() < need() then
  local function scan(pattern, each)
    local seen, cursor = {}, '0'
    repeat
      local page = redis.call('HSCAN', key, cursor, 'MATCH', pattern, 'COUNT', 4096)
      cursor = page[1]
      local fs = page[2]
      for i = 1, #fs, 2 do
        if not seen[fs[i]] then  -- (a scan may return a field twice)
          seen[fs[i]] = true
          each(fs[i], fs[i + 1])
        end
      end
    until cursor == '0'
  end
  -- The index, checked (and built again if it is not complete, or holds more than twice
  -- the members it needs) the first time the turn needs it; oq: the 'oq' to write then.
  local indexed = nil
  local function index()
    if indexed == nil then
      indexed = ORD ~= nil
      local m = indexed and redis.call('HMGET', key, 'sq', 'oq')
      if indexed and (m[1] ~= m[2] or not redis.call('ZSCORE', ORD, '~') or
          redis.call('ZCARD', ORD) > 2 * (H.n_s + H.n_r + H.n_m) + 64) then
        -- ('~' first: this call's first write, where a server out of memory refuses it,
        -- is one that adds; then every other member goes, an earlier incarnation's too)
        redis.call('ZADD', ORD, -1, '~')
        redis.call('ZREMRANGEBYSCORE', ORD, 0, '+inf')
        local z = {}
        scan('i:[srm]:*', function(f, rec)
          z[#z + 1] = order_score(string.sub(f, 3, 3), tonumber(string.match(rec, '(%d+)$')))
          z[#z + 1] = f
        end)
        call_each('ZADD', ORD, z)
        oq = m[1]
      end
    end
    return indexed
  end
  -- A consumer's items in sequence order, read as far as the turn goes: { list, done, ... }.
  -- (Pages by offset: nothing leaves the index before the turn's end, and members that
  -- share a score, an item's and a gone one's, are each read once.)
  local streams = {}
  local function fetch(st)
    local fs = redis.call('ZRANGEBYSCORE', ORD, st.from, st.to, 'LIMIT', st.at, st.size)
    st.done = #fs < st.size
    if #fs == 0 then return end
    st.at, st.size = st.at + #fs, math.min(st.size * 4, 1024)
    local recs = redis.call('HMGET', key, unpack(fs))
    for i, f in ipairs(fs) do
      if recs[i] then st.list[#st.list + 1] = parse(f, recs[i]) else stale[#stale + 1] = f end
    end
  end
  local function stream(c)
    local st = streams[c]
    if st then return st end
    st = { list = {}, done = false }
    streams[c] = st
    if ORDER[c] and index() then
      st.from, st.to, st.at, st.size = order_score(c, 0), '(' .. order_score(c, ORDER_SPAN), 0, 16
    else
      scan('i:' .. c .. ':*', function(f, rec) st.list[#st.list + 1] = parse(f, rec) end)
      table.sort(st.list, function(x, y) return x.sq < y.sq end)
      st.done = true
    end
    return st
  end
  -- Every item of c, oldest first.
  items = function(c)
    local st = stream(c)
    while not st.done do fetch(st) end
    return st.list
  end
  -- Calls each(item) for c's items oldest first, the items read as it goes, until each
  -- returns true.
  each_item = function(c, each)
    local st, i = stream(c), 1
    while true do
      if i > #st.list then
        if st.done then return end
        fetch(st)
      else
        if each(st.list[i]) then return end
        i = i + 1
      end
    end
  end
end
if rotating then
  for c in string.gmatch(R[1], '%a') do
    for _, it in ipairs(items(c)) do rotated = rotated + drop(c, it) end
  end
end
-- The index's writes at the end of the turn: the members found without their items
-- leave it, and 'oq' is written when it was built.
local function order_done(args)
  call_each('ZREM', ORD, stale)
  if oq then
    args[#args + 1], args[#args + 2] = 'oq', oq
    order_ttl(ORD, key, now, args)
  end
  return args
end
local regime, start_residual = 'ok', residual()
local util = math.floor(occupancy() * 1000 / H.W)
-- rule: working-set-gate (the demo's rule tests replace the next line)
if start_residual < need() then
  regime = occupancy() >= H.EV and 'loud' or 'starvation'
  -- The reclaim order, one consumer at a time, stopping as soon as the gap is closed.
  local function take(c, it)
    if residual() >= need() then return true end
    if not gone[it.f] then
      released = released + drop(c, it)
      reclaimed[#reclaimed + 1] = c .. ':' .. it.id
    end
  end
  -- rule: reclaim-order (the demo's rule tests replace the next line)
  each_item('s', function(it) return take('s', it) end)
  if residual() < need() then
    -- retrieval chunks recall also holds first (oldest first), then the others
    local recall, both = {}, {}
    for _, it in ipairs(items('m')) do if not gone[it.f] then recall[it.id] = true end end
    local ids = {}
    for id in pairs(recall) do ids[#ids + 1] = 'i:r:' .. id end
    for i = 1, #ids, 1000 do
      local part = { unpack(ids, i, math.min(i + 999, #ids)) }
      local recs = redis.call('HMGET', key, unpack(part))
      for k, f in ipairs(part) do if recs[k] then both[#both + 1] = parse(f, recs[k]) end end
    end
    table.sort(both, function(x, y) return x.sq < y.sq end)
    for _, it in ipairs(both) do if take('r', it) then break end end
    each_item('r', function(it)
      if not recall[it.id] then return take('r', it) end
    end)
  end
  if residual() < need() then each_item('m', function(it) return take('m', it) end) end
  if residual() < need() then
    local short = need() - start_residual
    -- Compacting working memory helps only as far as working memory itself is the
    -- requirement (its claim above the declared working set and what fits).
    local target = math.max(ws, H.F_w)
    local wm = items('w')
    table.sort(wm, function(x, y)
      if x.p ~= y.p then return x.p < y.p end
      return x.sq < y.sq
    end)
    local compact, held = {}, A.a_w
    if residual() >= target then
      for _, it in ipairs(wm) do
        if math.max(held, target) <= residual() then break end
        compact[#compact + 1] = 'w:' .. it.id
        held = held - it.t
      end
    end
    indicate(key, 'starvation', 1)
    if H.cd ~= 1 and worker_compacts(key) then enqueue(KEYS[2], 'compact', sid, H.ep, op, regime) end
    return commit(key, now, op, fp, table.concat({ 'status=refused|reason=',
      regime == 'loud' and 'compaction_pending' or 'starvation', '|requested=', need(),
      '|residual=', start_residual, '|need=', need(), '|utilization=', util, '|shortfall=', short,
      '|compact=', table.concat(compact, ','), '|free=', H.fr, '|epoch=', H.ep, '|turn=', H.tn,
      '|rolled_back=', rolled, '|reset=', reset_to }),
      order_done(H.cd == 1 and { 'cd', 1 } or { 'cd', 1, 'pm', 0 }), { gz = H.gz, xp = H.xp })
  end
  indicate(key, regime, 1)
end

if #dead > 0 then
  call_each('HDEL', key, dead)
  if ORD then  -- (a rollback of the turn, putting them back, makes the index incomplete)
    for _, f in ipairs(dead) do if ORDER[string.sub(f, 3, 3)] then stale[#stale + 1] = f end end
  end
end
local turn = H.tn + 1
local fr = free_room(H, out2, A.a_w, A.a_rm, A.a_s)
local due = (occupancy() > H.HW or H.cd == 1) and 1 or 0
local wm_budget = H.F_w > 0 and H.F_w or H.W
local rollup = (turn - H.kt > H.rut or A.a_w * 1000 > H.rup * wm_budget) and 1 or 0
-- The lease, the undo log (the output reserve and what this call reclaimed) and the
-- deliveries, now this turn's.
local le = now + lease
redis.call('ZADD', KEYS[3], le, sid .. '|' .. LEASE)
-- (the owner beginning again: its open turn ends here as it stands, its deliveries done)
if implicit or queued_s ~= '' or queued_d ~= '' then redis.call('HDEL', key, 'qs', 'qd', 'vs', 'vd') end
-- (pm: the memory admitted since a pending compaction, none of which survives a rollback)
local logged, was = { 'out', 'pm' }, { H.out, H.cd == 1 and (H.pm or 0) or 0 }
for i = 1, #dead do logged[i + 2], was[i + 2] = dead[i], dead_rec[i] end
local args = { 'tn', turn, 'out', out2, 'ws', ws, 'fr', fr, 'ai', 0, 'ao', 0, 'an', 0,
  'a_w', A.a_w, 'a_rm', A.a_rm, 'a_s', A.a_s, 'lo', owner, 'le', le, 'lb', op,
  'lk', redis.sha1hex(CALL_TOKEN),
  'ul', journal(nil, logged, was, true) }
if queued_s ~= '' then args[#args + 1], args[#args + 2] = 'vs', queued_s end
if queued_d ~= '' then args[#args + 1], args[#args + 2] = 'vd', queued_d end
for _, c in ipairs({ 'w', 'r', 'm', 's' }) do
  args[#args + 1] = 'u_' .. c
  args[#args + 1] = U[c]
  args[#args + 1] = 'n_' .. c
  args[#args + 1] = N[c]
end
order_done(args)
if due == 1 and H.cd ~= 1 then
  args[#args + 1] = 'cd'
  args[#args + 1] = 1
  -- the post-compaction baseline (admit.lua, reserve.lua) counts memory from now on
  args[#args + 1] = 'pm'
  args[#args + 1] = 0
  if worker_compacts(key) then enqueue(KEYS[2], 'compact', sid, H.ep, op, 'high_water_mark') end
end
return commit(key, now, op, fp, table.concat({ 'status=ok|regime=', regime, '|turn=', turn,
  '|residual=', residual(), '|need=', need(), '|utilization=', util, '|reclaimed=',
  table.concat(reclaimed, ','), '|rotated=', rotated, '|released=', released,
  '|compaction_due=', due, '|rollup=', rollup, '|free=', fr, '|epoch=', H.ep, '|summaries=', queued_s,
  '|dropped=', queued_d, '|lease=', le, '|rolled_back=', rolled, '|mark=', R[5] or '',
  '|landed=', landed, '|reset=', reset_to }), args,
  { gz = H.gz, xp = H.xp, uo = '' })
