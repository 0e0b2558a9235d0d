-- _common.lua: helpers shared by every ledger script.
--
-- The loader (ledger/scripts.py) prepends to each operation script the definitions
-- below that it uses, so every shipped script is one self-contained chunk. Only
-- `local` definitions at top level: each is cut with the comment lines above it.
-- Nothing here builds a key name: keys arrive only through KEYS.
--
-- BEGIN SCHEMA LEGEND (generated from ledger/schema/ by `python tools/legend.py`)
-- Consumer letters <c> (a letter means a consumer only): w working memory, r retrieval,
-- m recall, s scratchpad. The claim groups are named by their consumers' letters:
-- a_w/F_w working memory, a_rm/F_rm the memory group (retrieval r + recall m), a_s
-- scratchpad (no floor: F_s is never written). Units: tokens = tokens; ms = a duration
-- in ms; time = a time in ms on Redis's clock; count = a count; per_mille = per mille;
-- flag = 1 or 0; epoch = an epoch; turn = a turn number; id = an identifier (text); text
-- = text; binary = binary (control-character separated); version = a version number
-- (docs/protocol.md#versions).
--
-- session: the session hash '<tag>:s:<session>' (KEYS[1] of every session script)
--   lv             layout [version]: the session's stored layout version, written by the
--                  open that created it (the scripts' LAYOUT; absent: 1); scripts refuse
--                  a layout they do not read (LEDGER_VERSION)
--   ep             epoch [epoch]: the fence every call's ARGV[2] is checked against: a
--                  new incarnation starts at Redis's clock, each hard reset adds 1
--   tn             turn [turn]: the last turn begun (the open one while lo is set)
--   sq             sequence [count]: item sequence: each admitted item gets the next
--                  number
--   oq             order_through [count]: the reclaim-order index '<tag>:order:<session>'
--                  holds every scratchpad, retrieval and recall item while this equals sq
--                  (absent or other: rebuilt when next needed)
--   ox             order_ttl_at [time]: when the reclaim-order index's TTL is next set:
--                  the first call adding to it after this sets it again (absent: now)
--   inc            incarnation [time]: when this incarnation was created (a job's inc)
--   pe             past_epoch [epoch]: in a tombstone (a deleted session): its last epoch
--   cfg            budget_fingerprint [text]: the budget's fingerprint (SHA-256)
--   W              window [tokens]: the context window
--   S              system_prompt [tokens]: the system prompt
--   T              tool_framing [tokens]: the tool framing
--   out            output_reserve [tokens]: the output reserve of the current turn
--   R0             default_output_reserve [tokens]: the budget's output reserve (what
--                  begin_turn with '-' takes)
--   F_w            floor_working [tokens]: the working-memory group's floor
--   F_rm           floor_memory_group [tokens]: the memory group's floor (retrieval +
--                  recall)
--   F_s            floor_scratchpad [tokens]: never written: the scratchpad has no floor
--                  (read as 0)
--   HW             high_water_mark [tokens]: the high-water mark
--   EV             eviction_threshold [tokens]: the eviction threshold
--   fr             free [tokens]: W minus every claim (S, T, out, and per group the
--                  larger of its active tokens and its floor): kept exact by every script
--   a_w            active_working [tokens]: active tokens (items + open reservations) of
--                  the working-memory group
--   a_rm           active_memory_group [tokens]: active tokens of the memory group
--                  (retrieval + recall)
--   a_s            active_scratchpad [tokens]: active tokens of the scratchpad
--   u_<c>          held [tokens]: tokens held by consumer c's items
--   n_<c>          item_count [count]: consumer c's item count
--   v_<c>          reserved [tokens]: tokens held by consumer c's open reservations
--   nv             open_reservations [count]: open reservations
--   ttl            idle_ttl [ms]: the session's idle TTL
--   ort            op_retention [ms]: how long an outcome is kept
--   xp             ttl_refresh_at [time]: when the keys' TTLs are next refreshed
--   rel            released_each_turn [text]: consumers released at each begin_turn
--                  (letters, or '-')
--   pv             spill_preview [tokens]: a spilled tool result's preview
--   sttl           spill_ttl [ms]: how long a spilled result is kept
--   cx             escalate_after [count]: failed compactions that escalate to a reset
--   rut            rollup_turns [count]: roll-up turns
--   rup            rollup_share [per_mille]: roll-up share
--   ams            amplification_saturation [per_mille]: amplification threshold:
--                  saturation
--   amf            amplification_fragmentation [per_mille]: amplification threshold:
--                  fragmentation
--   amp            amplification_pathological [per_mille]: amplification threshold:
--                  pathological
--   ca             agent_compacts [flag]: 1: the agent compacts (no compaction jobs), 0:
--                  the worker
--   kg             min_gain [tokens]: a compaction's minimum gain
--   cd             compaction_pending [flag]: 1 while a compaction is pending
--   cq             compaction_requested_at [time]: when the last compaction job was
--                  requested (its entry id)
--   kp             staged_compaction [text]: a worker's compaction committed while a turn
--                  was open, landed by the next begin_turn (JSON: op, ep, id, t, items,
--                  text, read)
--   kf             failed_compactions [count]: consecutive failed compactions
--   kr             last_compaction_deferred [count]: the failed-compaction count (kf) a
--                  deferral left (applied, occupancy at or under the high-water mark,
--                  less than the minimum gain): equal to kf while that deferral is the
--                  last compaction judged; 0 after any other outcome or a reset
--   kn             compactions_done [count]: compactions done
--   kt             last_compaction_turn [turn]: the turn of the last compaction
--   rq             reset_requested [flag]: 1 once failed compactions escalated to a hard
--                  reset, until it is done
--   rz             staged_reset [text]: a hard reset that found a turn open with its
--                  lease live, applied by the call that ends the turn, or by a reset call
--                  once due: '<epoch>|<due ms>|<fingerprint>|<op id>|<reason>'
--                  (docs/rules.md#a-reset-waits-for-the-turns-end)
--   pm             memory_since_pending [tokens]: memory-group tokens admitted since the
--                  pending compaction became pending
--   ws             working_set [tokens]: this turn's working set
--   ai             span_input [tokens]: this turn's memory-tool spans: input tokens
--   ao             span_output [tokens]: this turn's memory-tool spans: output tokens
--   an             span_count [count]: this turn's memory-tool spans: how many
--   pu             last_utilization [per_mille]: utilization at the last end_turn
--   te             last_ended_turn [turn]: the last turn end_turn committed
--   dt             framing_tolerance [tokens]: the framing tolerance (-1: drift not
--                  judged)
--   dr             drift [tokens]: the last end_turn's drift (its prompt less the
--                  occupancy)
--   dp             last_prompt [tokens]: the last end_turn's prompt
--   df             drift_flagged [flag]: 1 when the last end_turn's drift was flagged
--   lo             turn_owner [id]: the open turn's owner: a turn is open exactly while
--                  lo is set
--   le             lease_until [time]: the end of the open turn's lease
--   lb             begun_by [id]: the op id of the begin_turn that opened the open turn
--                  (calls sent with it stamp '<epoch>@~<op id>')
--   lk             turn_key [text]: the SHA-1 (hex) of the open turn's owner token: a
--                  call into the turn must carry the token (ARGV[2] '...!<token>');
--                  absent: no call can prove the turn (begun by protocol 1)
--   ul             undo_log [binary]: the open turn's undo log: '\31<field>\30<value
--                  before>' per item or reservation field it changed, and 'out'
--   uo             turn_ops [binary]: the open turn's op keys (the outcomes a rollback
--                  removes)
--   qs             queued_summaries [text]: summary ids ('<id>,...') queued for the next
--                  turn
--   qd             queued_drops [text]: items to drop ('<c>:<id>,...') queued for the
--                  next turn
--   vs             delivered_summaries [text]: qs handed to the open turn (queued again
--                  on a rollback)
--   vd             delivered_drops [text]: qd handed to the open turn (queued again on a
--                  rollback)
--   cm             commit_mark [id]: the commit mark the last end_turn recorded
--   rb             rolled_back [text]: the last rolled-back turn: '<turn> <why>'
--   gz             rotate_at [time]: when the current outcome generation is rotated
--   i:<c>:<id>     item [text]: one item: '<tokens>|<turn>|<priority>|<seq>'
--   r:<id>         reservation [text]: one open reservation: '<c>|<tokens>|<deadline ms>'
--   k:<id>         child_pool [text]: the children of open reservation <id>:
--                  '<floors>|<drawn past floors>|<children>'
--   k:<id>|<child> child [text]: one child of reservation <id>: '<floor>|<used>'
--   x:last_reset   last_reset [text]: the last reset's reason
--   x:<name>       counter [count]: a telemetry counter (only ever incremented)
--
-- outcome: the outcome hashes '<tag>:out:<session>' and '<tag>:old:<session>' (the
-- current and previous generation; the last two KEYS of every mutating script)
--   <bucket>       bucket [binary]: the outcomes of the op ids whose SHA-1 starts with
--                  these 2 (3, 4) hex digits: '\30<key><fingerprint><coded reply>' each
--   e              epoch_base [epoch]: the generation's epoch base: the epoch of its
--                  first outcome
--   k              outcomes [count]: the outcomes the generation holds
--   g              had_previous [flag]: 0: the generation began when no previous one
--                  existed
--
-- tally: the partition's tally '<tag>:tally': each indicator counted in a session's
-- 'x:<name>' is counted here too, in the same step
--   drift          tally_drift [count]: indicator drift (docs/operations.md)
--   reconciled     tally_reconciled [count]: indicator reconciled (docs/operations.md)
--   refused        tally_refused [count]: indicator refused (docs/operations.md)
--   refused_pending tally_refused_pending [count]: indicator refused_pending
--                  (docs/operations.md)
--   expired        tally_expired [count]: indicator expired (docs/operations.md)
--   spilled        tally_spilled [count]: indicator spilled (docs/operations.md)
--   starvation     tally_starvation [count]: indicator starvation (docs/operations.md)
--   loud           tally_loud [count]: indicator loud (docs/operations.md)
--   failed_compactions tally_failed_compactions [count]: indicator failed_compactions
--                  (docs/operations.md)
--   escalations    tally_escalations [count]: indicator escalations (docs/operations.md)
--   resets         tally_resets [count]: indicator resets (docs/operations.md)
--   rolled_back    tally_rolled_back [count]: indicator rolled_back (docs/operations.md)
--   evicted_memory tally_evicted_memory [count]: indicator evicted_memory
--                  (docs/operations.md)
--   fanout_refused tally_fanout_refused [count]: indicator fanout_refused
--                  (docs/operations.md)
--   refused_ceiling tally_refused_ceiling [count]: indicator refused_ceiling
--                  (docs/operations.md)
--   refused_child  tally_refused_child [count]: indicator refused_child
--                  (docs/operations.md)
--   class:<class>  tally_class [count]: ended turns of one amplification class
--
-- job: an entry of the partition's job stream '<tag>:jobs' (written in this order)
--   kind           kind [text]: compact or hard_reset
--   session        session [id]: the session id
--   epoch          epoch [epoch]: the session's epoch when the job was written
--   reason         reason [text]: why the job was written
--   op             op [id]: the op id of the call that wrote the job
--   inc            incarnation [time]: the session's inc, 0 if unknown
--
-- summary: the JSON record of one summary, in the summaries hash
--   text           text [text]: the summary's text
--   replaced       replaced [text]: the items it replaced: ['<c>:<id>', ...]
--   at             at [time]: when the compact that stored it ran
--   tokens         tokens [tokens]: the summary's tokens as its compactor counted them
--
-- compacted: the summaries hash '<tag>:compacted:<session>'
--   <summary_id>   summary [text]: a SummaryRecord (JSON)
--   ~              compacting [text]: '<worker>|<until ms>' while a worker computes the
--                  session's compaction
--
-- content: the content store '<tag>:content:<session>'
--   <c>:<id>       content [text]: an item's text (see content_field)
--
-- spill: the spill hash '<tag>:spill:<session>'
--   <call_id>      spilled [text]: a spilled tool result's content
--
-- history: the history hash '<tag>:history:<session>'
--   <version>      history [text]: a JSON list of the conversation's items
--
-- scope: a budget scope's hash '<tag>:t:<scope>' (docs/ceilings.md): a tenant, or a key
-- or user within it, in the tenant's partition; quantities <q>: i input, o output, c
-- cached input tokens, $ micro-cents
--   L              scope_window [ms]: layout 2's window length (into cf)
--   G              scope_bucket [ms]: layout 2's bucket length (into cf)
--   hl             scope_hold_limit [ms]: layout 2's hold limit (into cf)
--   k              counted [text]: layout 2's kinds c_t counts (into cf)
--   op             scope_set_by [id]: the op id of the set_scope that set it
--   p:<model>      price [text]: '<input>|<output>|<cached input>' cents per million
--                  tokens ('p:*': any other model)
--   bl             buckets [text]: the buckets kept before the live one ('<bucket>,...')
--   cf             scope_config [binary]: the config, packed (struct '<8qB':
--                  little-endian 8-byte integers, then one byte): the window L and bucket
--                  G (ms; a window is L/G buckets: one fixed, more rolling), the hold
--                  limit (ms), the ceilings input, output, cached input, tokens, money
--                  (micro-cents; -1: none), and the kinds the tokens ceiling counts as
--                  bits (1 input, 2 output, 4 cached)
--   w              live [binary]: the live bucket and its counters, packed (struct
--                  '<7q'): the bucket (now // G; -1: none), what it charged of input,
--                  output, cached input and money, its open holds, and a time no open
--                  hold's deadline is earlier than
--   wb             live_bucket [count]: layout 2's live bucket (into w)
--   w<q>           live_charged [count]: layout 2's live counter of q (into w)
--   wn             live_open_holds [count]: layout 2's live open holds (into w)
--   nd             next_deadline [time]: layout 2's next deadline (into w)
--   <bucket>:<q>   charged [count]: what bucket <bucket> (now // G), once not live,
--                  charged of quantity q: open holds and billed usage
--   <bucket>:u<q>  billed [count]: what bucket <bucket> billed of quantity q
--   <bucket>:xt    bucket_over [tokens]: tokens bucket <bucket>'s settles billed past
--                  their holds
--   <bucket>:x$    bucket_over_money [count]: micro-cents billed past holds in bucket
--                  <bucket>
--   <bucket>:n     open_holds [count]: bucket <bucket>'s open holds
--   q:<session>|<id> hold [text]: an open hold: '<bucket>|<i>|<o>|<c>|<$>|<price i>|<price
--                  o>|<price c>|<scopes>'
--   nr             scope_refused [count]: reservations this scope refused
--   ot             scope_over [tokens]: tokens settles billed past their holds
--   om             scope_over_money [count]: micro-cents settles billed past their holds
--
-- scope_holds: a budget scope's holds index '<tag>:th:<scope>' (sorted set)
--   <session>|<id> hold_deadline [time]: member: an open hold, scored by its deadline
-- END SCHEMA LEGEND
--
-- An item's turn is the turn that admitted it: while a turn is open, an item of that
-- turn is one the turn added (calls of no turn are refused while a turn is open).
--
-- The first commit after gz renames the current generation to the previous one (the
-- one it replaces is at least one op retention old) and gives that one the op
-- retention as its TTL: an outcome lives at least the op retention, at most about
-- twice that, with no timestamp or journal per outcome.

-- The protocol version these scripts speak, and the oldest stored layout they read
-- (docs/protocol.md#versions): written by `python tools/legend.py` from ledger/protocol.py
-- (VERSION, LAYOUT, OLDEST_LAYOUT), never by hand. Every call carries its client's protocol version
-- (`op_args`, `protocol_arg`); every session stores its layout version in 'lv' (absent: 1).
local VERSION, LAYOUT, OLDEST_LAYOUT = 4, 2, 1

-- What `op_args` read from this call's ARGV[2] besides the epoch and the turn: the owner
-- token (false when the call sends none), which `fence` and begin_turn check against 'lk'.
-- (A variable, not a table's field: a table is built again on every call.)
local CALL_TOKEN = false

-- Each consumer's claim group, its fields spelled with the letters of the consumers it
-- holds: ACTIVE[c] holds the group's active tokens, FLOOR[c] its floor. The memory group
-- (a_rm, F_rm) is retrieval r and recall m. The scratchpad has no floor: F_s is never
-- written, and read as 0.
local ACTIVE = { w = 'a_w', r = 'a_rm', m = 'a_rm', s = 'a_s' }
-- The reclaim-order index '<tag>:order:<session>' (docs/protocol.md#the-reclaim-order-index):
-- a sorted set of the items of the consumers a turn reclaims, member the item's field
-- 'i:<c>:<id>', score ORDER[c] * ORDER_SPAN + the item's sequence number, so that each
-- consumer's items lie in one range of scores, oldest first; and the member '~' (score
-- -1) once it was built from the session's items. It may hold members of items gone
-- (they are skipped and removed when read). It holds every live item while it holds '~'
-- and the session's 'oq' equals its 'sq': each script that adds such an item either
-- adds its member and moves 'oq' along with 'sq', or leaves 'oq' behind. A caller that
-- does not send the index (an older client) so leaves it incomplete, as a new session
-- (no 'oq') is, and a rollback that puts an item back; the next turn that needs it
-- builds it again (begin_turn.lua).
local ORDER = { s = 0, r = 1, m = 2 }
local ORDER_SPAN = 1125899906842624  -- 2^50: above any sequence number

-- redis.call(cmd, key, ...list) in calls of at most 1000 of the list's values: Lua unpacks
-- at most about 8,000 values at once, and a turn may rotate, reclaim or reconcile more
-- items than that. (A list of pairs stays whole pairs: 1000 is even.)
local function call_each(cmd, key, list)
  for i = 1, #list, 1000 do redis.call(cmd, key, unpack(list, i, math.min(i + 999, #list))) end
end

-- Remove the members `fields` from the reclaim-order index `ord`. True when that emptied it
-- (Redis then deletes the key, and its TTL with it): the caller writes 'ox' 0, so that
-- the next call that adds to it sets its TTL again.
local function order_remove(ord, fields)
  call_each('ZREM', ord, fields)
  return redis.call('EXISTS', ord) == 0
end

-- An item's score in the reclaim-order index: its consumer's range, then its sequence.
local function order_score(c, sq)
  return string.format('%d', ORDER[c] * ORDER_SPAN + sq)
end

-- Give the reclaim-order index `ord` the session's idle TTL, and add to args the
-- session's 'ox': when it is next due (in a tenth of the TTL, as the session's own).
local function order_ttl(ord, key, now, args)
  local ttl = tonumber(redis.call('HGET', key, 'ttl'))
  redis.call('PEXPIRE', ord, ttl)
  args[#args + 1], args[#args + 2] = 'ox', string.format('%d', now + math.floor(ttl / 10))
end

-- After a call added items of consumer c, the session's sequence moving from sq0 to sq1:
-- the reclaim-order index stays complete (its 'oq' follows to sq1) when it was (oq equals
-- sq0; both strings or both numbers, as the caller read them) and either the items need
-- no member (working memory) or the index `ord` was sent, their members z (score, member,
-- ...) then added. Returns whether it stayed complete. The index's TTL is set again once
-- the session's 'ox' (`ox`, nil if absent) has passed; an index that expired has always
-- passed it (it expires a whole TTL after it was set, ox a tenth of one), and one that a
-- removal emptied set 'ox' to 0 (order_remove), so no call leaves an index without a TTL.
-- (c ~= 'w': ORDER[c], without the table, which a call would build again)
local function order_keep(ord, c, oq, sq0, sq1, z, ox, now, key, args)
  if oq ~= sq0 or (c ~= 'w' and not ord) then return false end
  args[#args + 1], args[#args + 2] = 'oq', sq1
  if c ~= 'w' then
    redis.call('ZADD', ord, unpack(z))
    if not ox or now >= tonumber(ox) then order_ttl(ord, key, now, args) end
  end
  return true
end

local FLOOR = { w = 'F_w', r = 'F_rm', m = 'F_rm', s = 'F_s' }
local ID_MAX = 128
local TOKENS_MAX = 100000000      -- 1e8 tokens: above any model's window
local NEVER = 999999999999999

-- Refuse the call: raise a tagged error, which the wrapper every script runs in (see
-- ledger/scripts.py) sends as the error reply 'LEDGER_<code> <msg>'. Any other error
-- (a Redis command's) passes through the wrapper unchanged.
local function fail(code, msg)
  error({ ledger = code, msg = msg })
end

local function show(v)
  if type(v) ~= 'string' then return tostring(v) end
  local s = string.gsub(string.sub(v, 1, 48), '[^%w%p ]', '?')
  if #v > 48 then s = s .. '...' end
  return "'" .. s .. "'"
end

-- Refuse a call of another protocol version than these scripts' (LEDGER_VERSION, naming
-- both, before anything is read or written). `got`: the version the call carries, or
-- nil when it carries none (a client of protocol 1, which had no version).
local function version_mismatch(got)
  fail('VERSION', 'protocol version mismatch: the call is of protocol ' .. (got or '1 (it carries ' ..
    'no version)') .. ', these scripts are of protocol ' .. VERSION .. ': run client, worker and ' ..
    'scripts of one protocol version (docs/operations.md#upgrades)')
end

-- A read-only script's ARGV[1]: the protocol version of the call, which must be VERSION.
local function protocol_arg(v)
  if v ~= tostring(VERSION) then
    version_mismatch(type(v) == 'string' and string.match(v, '^[1-9]%d?$') or nil)
  end
end

-- A session's stored layout version (field 'lv' as read; absent: 1, a session written
-- before versions were stored) must be one these scripts read: OLDEST_LAYOUT..LAYOUT.
-- Else LEDGER_VERSION, naming both, before anything is written: a session of a newer
-- layout is not read with an older one's field names (nor an older one with a newer's).
local function layout_check(lv)
  local n = tonumber(lv) or 1
  if n < OLDEST_LAYOUT or n > LAYOUT then
    fail('VERSION', 'stored layout mismatch: the session is of layout ' .. n .. ', these ' ..
      'scripts are of protocol ' .. VERSION .. ' and read layouts ' .. OLDEST_LAYOUT .. ' to ' ..
      LAYOUT .. (n > LAYOUT and ': upgrade this client' or ': migrate the session') ..
      ' (docs/operations.md#upgrades)')
  end
end

-- A decimal integer in [lo, hi], written canonically ('0', or an optional '-' and
-- digits with no leading zero: one number, one spelling, so one fingerprint); returns
-- n, or fails with BADARG. `of`, when given, names the item the number belongs to
-- (joined only on error).
local function int_arg(v, name, lo, hi, of)
  -- (v + 0, not tonumber(v): tonumber converts a string twice; the pattern has made sure
  -- that v is a decimal integer)
  -- (`v and`, not type(v) == 'string': every caller passes a string or nil)
  local n = v and #v <= 16 and (v == '0' or string.find(v, '^%-?[1-9]%d*$')) and v + 0
  if n and n >= lo and n <= hi then return n end
  if of then name = name .. ' of ' .. of end
  if not n then
    fail('BADARG', name .. ' must be an integer written canonically (no sign on 0, no ' ..
      'leading zero), got ' .. show(v))
  end
  fail('BADARG', name .. ' must be between ' .. lo .. ' and ' .. hi .. ', got ' .. v)
end

-- An identifier: 1..128 characters of [A-Za-z0-9._:/@+=#-]: no braces, no separators.
-- (`v and`, not type(v) == 'string': every caller passes a string or nil)
local function id_arg(v, name)
  if v and #v <= ID_MAX and string.find(v, '^[%w%._:/@%+=#%-]+$') then return v end
  fail('BADARG', name .. ' must be 1-' .. ID_MAX .. ' characters of [A-Za-z0-9._:/@+=#-], got ' .. show(v))
end

-- The session id in ARGV (a member prefix of the deadline index, a job's session)
-- must be exactly the one KEYS[1] names: '<prefix>:{p<N>}:s:<session id>' (a prefix
-- has no braces, so the first '{p<N>}' is the hash tag).
local function session_arg(v)
  local sid = id_arg(v, 'session id')
  if string.match(KEYS[1] or '', '^[^{]*{p%d+}:s:(.+)$') ~= sid then
    fail('BADARG', 'session id ' .. sid .. ' does not name the session key ' .. show(KEYS[1]))
  end
  return sid
end

-- The hash tag and session id of KEYS[1] ('<prefix>:{p<N>}' and '<session>'), once
-- `op_args` has read and checked them (false before), for `key_arg`.
local KEY_TAG, KEY_SID = false, false

-- KEYS[i], KEYS[i + 1], ... must be the keys that the suffixes given name for the
-- session in KEYS[1] ('<prefix>:{p<N>}:s:<session>': '<prefix>:{p<N>}:<suffix>'), in that
-- order, followed only by the partition's tally and the two outcome hashes; '%s' in a suffix stands for the
-- session id. The names are only compared, never used to reach a key: the scripts use
-- KEYS as given.
local function key_arg(i, ...)
  local tag, sid = KEY_TAG, KEY_SID
  if not tag then tag, sid = string.match(KEYS[1] or '', '^([^{]*{p%d+}):s:(.+)$') end
  local n = select('#', ...)
  local ok = tag ~= nil and #KEYS == i + n + 2
  local pre = ok and tag .. ':'
  for k = 1, n do
    if not ok then break end
    ok = KEYS[i + k - 1] == pre .. string.format((select(k, ...)), sid)
  end
  if not ok then  -- (the names wanted are built only for the message)
    local shown = {}
    for k = 1, n do
      local suffix = select(k, ...)
      shown[k] = show(tag and (tag .. ':' .. string.format(suffix, sid)) or suffix)
    end
    fail('BADARG', 'KEYS must be the session key, ' .. table.concat(shown, ', ') ..
      ', the tally and the outcome keys, got ' .. #KEYS .. ' keys: ' .. show(KEYS[i]))
  end
end

-- Whether KEYS[i] is the session's key with this suffix (an optional key told apart
-- from another by its name; key_arg then checks them all).
local function is_key(i, suffix)
  local tag, sid = string.match(KEYS[1] or '', '^([^{]*{p%d+}):s:(.+)$')
  return tag ~= nil and KEYS[i] == tag .. ':' .. string.format(suffix, sid)
end

-- reset and void: ARGV[3] the session id (naming KEYS[1]) and ARGV[4] one identifier
-- (`what` names it in a refusal), nothing more; KEYS[2] the partition deadline index,
-- then the keys the suffixes given name (see `key_arg`). Returns the session id and the
-- identifier, or fails with BADARG, in that order, before anything is read or written.
local function sid_and_id(what, ...)
  local sid = session_arg(ARGV[3])
  local id = id_arg(ARGV[4], what)
  if #ARGV ~= 4 then fail('BADARG', 'expected 4 arguments, got ' .. #ARGV) end
  key_arg(2, 'deadlines', ...)
  return sid, id
end

-- (compared, not looked up in ACTIVE: a script that needs no ACTIVE does not build it)
local function consumer_arg(v)
  if v ~= 'w' and v ~= 'r' and v ~= 'm' and v ~= 's' then
    fail('BADARG', 'consumer must be one of w (working_memory), r (retrieval), m (recall), ' ..
      's (scratchpad), got ' .. show(v))
  end
  return v
end

-- A consumer's name as the clients spell it, for messages (built only when asked).
local function consumer_name(c)
  return ({ w = 'working_memory', r = 'retrieval', m = 'recall', s = 'scratchpad' })[c] or c
end

-- The partition's tally and the outcome hashes: the last three KEYS of every mutating
-- script (checked by op_args).
local TALLY, OUT, OLD = KEYS[#KEYS - 2], KEYS[#KEYS - 1], KEYS[#KEYS]

-- Count an indicator (docs/operations.md#metrics): the session's telemetry counter
-- 'x:<name>' and the same field of its partition's tally, which outlives the session,
-- grow by n in the same step. The tally is what the worker exports for the fleet.
local function indicate(key, name, n)
  redis.call('HINCRBY', key, 'x:' .. name, n)
  redis.call('HINCRBY', TALLY, name, n)
end

-- The prologue of every mutating call: ARGV[1] op id, ARGV[2] the call's protocol
-- version and ':' (first of all: a call of another version, or of none, is refused with
-- LEDGER_VERSION naming both, see `version_mismatch`), then the epoch the caller believes
-- current ('*' where the script allows an unfenced call), followed by '@<turn>' for a call
-- made in that turn, or '@~<op id>' for a call made in the turn that the begin_turn of that
-- op id opened (sent with it, its number not known yet; see `fence`), and last, for a call
-- of a turn and for begin_turn, '!<owner token>' (16-64 hex digits: the secret of the
-- handle that begins or serves the turn, kept in CALL_TOKEN; see `fence`). Returns op,
-- the call's fingerprint, epoch (nil for '*') and turn (nil for a
-- call of no turn; the string '~<op id>' for a turn named by its begin), or fails with
-- BADARG. The fingerprint is computed here, by the server, over the script's name and
-- every argument after the op id, ARGV[2] with only its epoch (the first 12 hex digits
-- of their SHA-1): a client cannot claim one, so an op id sent again with other
-- arguments is always refused, whatever the client. It also
-- checks that the last three KEYS are the tally of the partition and the outcome hashes
-- of the session in KEYS[1].
local function op_args(name, unfenced_ok)
  local v, head = string.match(ARGV[2] or '', '^([1-9]%d?):(.*)$')  -- (ARGV holds strings)
  if not v or v + 0 ~= VERSION then version_mismatch(v) end  -- (v: digits; v + 0, no text of VERSION)
  local tag, sid = string.match(KEYS[1] or '', '^([^{]*{p%d+}):s:(.+)$')
  if not tag or #KEYS < 4 or TALLY ~= tag .. ':tally' or OUT ~= tag .. ':out:' .. sid or
      OLD ~= tag .. ':old:' .. sid then
    fail('BADARG', 'KEYS must end with the partition\'s tally and the outcome keys of the ' ..
      'session key ' .. show(KEYS[1]) .. ', got ' .. #KEYS .. ' keys')
  end
  KEY_TAG, KEY_SID = tag, sid
  local op = id_arg(ARGV[1], 'operation id')
  if unfenced_ok and head == '*' then
    local rest = #ARGV > 2 and ('\31' .. table.concat(ARGV, '\31', 3)) or ''
    return op, string.sub(redis.sha1hex(name .. '\31*' .. rest), 1, 12), nil
  end
  local e, t = head, nil
  local bang = string.find(e, '!', 1, true)
  if bang then
    local token = string.sub(e, bang + 1)
    if #token < 16 or #token > 64 or not string.match(token, '^%x+$') then
      fail('BADARG', 'owner token must be 16-64 hex digits, got ' .. show(token))
    end
    e, CALL_TOKEN = string.sub(e, 1, bang - 1), token
  end
  local at = type(e) == 'string' and string.find(e, '@', 1, true)  -- (the first '@')
  if at and string.sub(e, at + 1, at + 1) == '~' then
    e, t = string.sub(e, 1, at - 1), '~' .. id_arg(string.sub(e, at + 2), 'op id of the turn of the call')
  elseif at then
    e, t = string.sub(e, 1, at - 1), int_arg(string.sub(e, at + 1), 'turn of the call', 1, 1e15)
  end
  -- The turn a call is stamped with is a fence, not an argument: the same call sent
  -- again from another turn has the same fingerprint (and gets its first outcome back).
  -- (A call of many arguments, texts among them, is joined in one table.concat: joining
  -- ARGV and then the name and epoch before it copies its texts twice.)
  local signed
  if #ARGV > 24 then
    signed = table.concat({ name, e, unpack(ARGV, 3) }, '\31')
  else
    signed = #ARGV > 2 and (name .. '\31' .. e .. '\31' .. table.concat(ARGV, '\31', 3)) or
      (name .. '\31' .. tostring(e))
  end
  local fp = string.sub(redis.sha1hex(signed), 1, 12)
  return op, fp, int_arg(e, 'epoch', 0, 1e15), t
end

-- (TIME's two numbers as text, converted by the arithmetic: tonumber converts twice; the
-- microseconds' whole milliseconds without math.floor's call)
local function now_ms()
  local t = redis.call('TIME')
  local us = t[2] + 0
  return t[1] * 1000 + (us - us % 1000) / 1000
end

-- Reply keys as stored in an outcome: '|<key>=' is one control character (a key not
-- listed stays as it is; replies hold no control characters). A function: the table is
-- built only by a call that codes a reply with it (`pack`) or decodes one (`replay`), not
-- by every call (admit codes its own reply, see `store`).
local function pack_codes()
  return {
    ['|status='] = '\1', ['|reason='] = '\2', ['|requested='] = '\3', ['|free='] = '\4',
    ['|epoch='] = '\5', ['|turn='] = '\6', ['|charged='] = '\7', ['|admitted='] = '\8',
    ['|duplicates='] = '\9', ['|skipped='] = '\10', ['|released='] = '\11', ['|count='] = '\12',
    ['|missing='] = '\13', ['|reservation='] = '\14', ['|deadline_ms='] = '\15',
    ['|item='] = '\16', ['|expired='] = '\17', ['|pending='] = '\18', ['|dropped='] = '\19',
    ['|created='] = '\20', ['|deleted='] = '\21', ['|regime='] = '\22', ['|residual='] = '\23',
    ['|need='] = '\24', ['|utilization='] = '\25', ['|reclaimed='] = '\26', ['|rotated='] = '\27',
    ['|compaction_due='] = '\28', ['|rollup='] = '\29'
  }
end

-- The stored form of an outcome: the fingerprint (12 characters), then '|' .. reply
-- with its keys coded and its epoch, if it has one, written as its difference to
-- `base` (the generation's field 'e', as stored): '0' for a call at that epoch, not 13
-- digits. (Both are written canonically: the same text is the same number.)
local function pack(fp, out, base)
  local _, j = string.find(out, '|epoch=', 1, true)
  if j then
    local k = string.find(out, '|', j + 1, true) or #out + 1
    local e = string.sub(out, j + 1, k - 1)
    out = string.sub(out, 1, j) .. (e == base and '0' or string.format('%d', e - base)) ..
      string.sub(out, k)
  end
  return fp .. string.gsub('|' .. out, '|[%w_]+=', pack_codes())
end

-- The current generation's bucket of this call's op id, as `recorded` read it, for
-- `store` to append to: the op's SHA-1 (h), its record key (at), the bucket field it is
-- written to (b) and that bucket's text (cur), the generation's outcome count (k) and
-- epoch base (e); and the base of the generation a stored outcome was found in (found).
-- Its fields are given at creation (false: none yet), so that `recorded` fills a table
-- of the right size rather than growing one field by field.
local BUCKET = { h = false, at = false, b = false, cur = false, k = false, e = false, found = false }

-- The outcome stored for this op id in either generation ('<fingerprint><coded
-- reply>'), or false. Every mutating script calls it before `store`. An op id is kept
-- as 16 hex digits of its SHA-1: the first two to four name its bucket, digits 3 to 16
-- (56 bits) mark its record, so a record's size does not depend on the op id's length.
-- The previous generation is read only when there may be one (field 'g' of the current
-- one: 0 when it began with none; absent in a generation an older version began).
-- A generation's outcomes go to buckets named by the first 2 hex digits of the op id's
-- SHA-1 until it holds 8,192 outcomes, then by the first 3 (4,096 buckets) until
-- 8,192 + 131,072, then by 4: a bucket a call rewrites keeps about 32 outcomes however
-- many the generation holds, and a field costs little next to the outcomes in it. Records
-- already written stay where they are; a lookup reads the op's bucket of each width (got:
-- the HMGET of its 2-, 3- and 4-digit buckets).
local function recorded(op)
  local h = redis.sha1hex(op)
  local b4, b3, b2 = string.match(h, '^(((..).).)')  -- (its first 4, 3 and 2 digits)
  local at = '\30' .. string.sub(h, 3, 16)
  local got = redis.call('HMGET', OUT, b2, b3, b4, 'e', 'k', 'g')
  local k = got[5] and got[5] + 0 or 0  -- (a count as stored: + 0 converts it once, tonumber twice)
  local w = k < 8192 and 2 or k < 8192 + 131072 and 3 or 4  -- (the width this generation writes)
  BUCKET.h, BUCKET.at, BUCKET.k, BUCKET.e, BUCKET.found = h, at, k, got[4], got[4]
  BUCKET.b, BUCKET.cur = w == 2 and b2 or w == 3 and b3 or b4, got[w - 1] or ''
  for gen = 1, 2 do
    for i = 1, 3 do
      local src = got[i]
      if src then
        local _, j = string.find(src, at, 1, true)
        if j then return string.sub(src, j + 1, (string.find(src, '\30', j + 1, true) or 0) - 1) end
      end
    end
    if gen == 2 or got[6] == '0' then return false end
    got = redis.call('HMGET', OLD, b2, b3, b4, 'e')
    BUCKET.found = got[4]
  end
end

-- Append the outcome of the op `recorded` looked up to its bucket in the current
-- generation (fresh: the generation was just rotated, it starts empty). The first
-- outcome of a generation sets its epoch base 'e': its own epoch, or, for a reply
-- without one (the worker's `expire`), the session's (KEYS[1]), else its last one; and
-- 'g': 0 when no previous generation exists. c1, ce, c3, when given: the reply as its
-- script coded it (admit), so that it is not coded again: the coded reply up to and
-- including its epoch's code ('\5'), its epoch as in the reply, the coded rest; stored
-- exactly as `pack` stores the reply.
-- (The bucket is the one `recorded` named, of the width of the generation's count as it
-- read it; a generation just rotated starts empty, at width 2.)
local function store(fp, out, fresh, c1, ce, c3)
  local cur, base, k, b = BUCKET.cur, BUCKET.e, BUCKET.k, BUCKET.b
  if fresh then cur, base, k, b = '', nil, 0, string.sub(BUCKET.h, 1, 2) end
  BUCKET.b = b
  local rec
  if not base then
    base = ce or string.match(out, '|epoch=(%d+)')
    if not base then
      local h = redis.call('HMGET', KEYS[1], 'ep', 'pe')
      base = h[1] or h[2] or '0'
    end
  end
  if c1 then  -- (the epoch as pack writes it: its difference to the base)
    rec = cur .. BUCKET.at .. fp .. c1 .. (ce == base and '0' or string.format('%d', ce - base)) .. c3
  else
    rec = cur .. BUCKET.at .. pack(fp, out, base)
  end
  if BUCKET.e and not fresh then
    redis.call('HSET', OUT, b, rec, 'k', string.format('%d', k + 1))
    return
  end
  redis.call('HSET', OUT, b, rec, 'e', base,
    'k', string.format('%d', k + 1), 'g', fresh and '1' or redis.call('EXISTS', OLD))
end

-- A stored outcome for this op id: the reply to send again, or nil when the op is
-- new; fails with OPREUSED when the id was used with other arguments.
local function replay(rec, op, fp)
  if not rec then return nil end
  if string.sub(rec, 1, 12) ~= fp then
    fail('OPREUSED', 'operation id ' .. op .. ' was already used with other arguments')
  end
  local key = {}
  for k, c in pairs(pack_codes()) do key[c] = k end
  local base = tonumber(BUCKET.found) or 0
  local text = string.sub(string.gsub(string.sub(rec, 13), '%c', key), 2)
  return (string.gsub(text, '|epoch=(%-?%d+)', function(d)
    return '|epoch=' .. string.format('%d', base + tonumber(d))
  end, 1))
end

local NOSESSION = 'session does not exist (never opened, closed or expired)'

-- A call at another epoch than the session's is stale: an older one is of a handle from
-- before a hard reset or of an earlier incarnation; a newer one can only be of an earlier
-- incarnation whose epoch ran ahead (resets add one each) or of a session whose last
-- writes were lost (a failover): in no case of this session as it is.
local function stale(ep, epoch)
  if epoch == nil or epoch == ep then return end
  if epoch < ep then
    fail('STALE', 'epoch ' .. epoch .. ' is older than the session epoch ' .. ep)
  end
  fail('STALE', 'epoch ' .. epoch .. ' is newer than the session epoch ' .. ep ..
    ' (a handle of an earlier incarnation of this id, or of writes Redis lost)')
end

-- The checks every mutating call makes once its fields are read, given the outcome
-- stored for its op id (rec, from `recorded`) and the session's epoch (ep, a number or nil), in this order: a
-- stored outcome is replayed, a missing session, a session of a stored layout these
-- scripts do not read (`layout_check`) and a stale epoch are refused. `lv`: the
-- session's field 'lv' where the caller read it with its own fields (false when absent),
-- else nil (read here).
-- Returns the stored reply to send again, or nil to go on (else it fails).
local function gate(rec, ep, op, fp, epoch, lv)
  if rec then return replay(rec, op, fp) end
  if not ep then fail('NOSESSION', NOSESSION) end
  if lv == nil then lv = redis.call('HGET', KEYS[1], 'lv') end
  layout_check(lv)
  if epoch ~= nil and epoch ~= ep then stale(ep, epoch) end  -- (stale's own test, without its call)
end

-- The member of the deadline index that stands for a session's turn lease: '~' is no
-- id's character, so it never names a reservation.
local LEASE = '~'

-- A call of no turn while a turn is open: refused (TURNHELD), naming the owner and the
-- time its lease has left (negative once it lapsed: the next begin_turn or the worker
-- rolls the turn back).
-- `why`, when given, replaces the advice at the end of the message.
local function turn_held(key, lo, tn, why)
  local le = tonumber(redis.call('HGET', key, 'le')) or 0
  fail('TURNHELD', 'turn ' .. tn .. ' is held by ' .. lo .. ' (lease ' .. (le - now_ms()) ..
    ' ms left): ' .. (why or 'only its calls are accepted; wait for it, or begin_turn with takeover'))
end

-- Whether this call carries the open turn's owner token: the SHA-1 of CALL_TOKEN (from
-- ARGV[2], see `op_args`) is the session's 'lk' (`lk` as read, false when absent: a
-- turn begun by a client of protocol 1, which no call of protocol 2 can prove).
local function owns(lk)
  return lk and CALL_TOKEN and redis.sha1hex(CALL_TOKEN) == lk or false
end

-- Why a call of the open turn that does not carry the turn's owner token (a handle naming
-- another's turn by its number) is refused as a call of no turn is (TURNHELD, nothing
-- changed): `turn_held`'s `why` (one text, not a function nor a concatenation: nothing
-- made per call).
local NOT_OWNER = 'this call names that turn but does not carry its owner token (only the handle that began the turn can call into it)'

-- Whether a call belongs to the open turn, given the session's lease owner (lo, nil
-- when no turn is open), its turn (tn: a number, or field tn as read) and the turn the
-- call is stamped with (tok, nil for a call of no turn, '~<op id>' for the turn that
-- begin_turn opened; see `op_args`): true for a call of the open turn, false for a call
-- of no turn while none is open. A call of no turn while a turn is open fails with
-- TURNHELD; a call of a turn that is not open (ended, rolled back, or followed by
-- another) fails with TURNLOST. Either way nothing has changed. `unleased`: end_turn and
-- record_span also account the current turn when it never held a lease (turn 0, before
-- any begin_turn): false then.
local function fence(key, lo, tn, tok, unleased)
  if not tok then
    if lo then turn_held(key, lo, tn) end
    return false
  end
  tn = tonumber(tn)  -- (the caller may pass the field as read: a call of no turn needs no number)
  if lo and tok == tn then
    if not owns(redis.call('HGET', key, 'lk')) then turn_held(key, lo, tn, NOT_OWNER) end
    return true
  end
  if type(tok) == 'string' then
    local by = string.sub(tok, 2)
    local b = lo and redis.call('HMGET', key, 'lb', 'lk')
    if b and b[1] == by then
      if not owns(b[2]) then turn_held(key, lo, tn, NOT_OWNER) end
      return true
    end
    fail('TURNLOST', 'the turn begun by op ' .. by .. ' is not open' ..
      (lo and (' (turn ' .. tn .. ' is, held by ' .. lo .. ')') or ''))
  end
  local v = redis.call('HMGET', key, 'rb', 'te')
  local why = ''
  local rt, rwhy = string.match(v[1] or '', '^(%d+) (.*)$')
  if tonumber(rt) == tok then
    why = ': it was rolled back (' .. rwhy .. ')'
  elseif tonumber(v[2]) == tok then
    why = ': it has ended'
  elseif unleased and not lo and tok == tn then
    return false
  end
  if lo then why = why .. ' (turn ' .. tn .. ' is, held by ' .. lo .. ')' end
  fail('TURNLOST', 'turn ' .. tok .. ' is not open' .. why)
end

-- Two comma-separated lists as one, a's entries first.
local function cat(a, b)
  if not a or a == '' then return b or '' end
  if not b or b == '' then return a end
  return a .. ',' .. b
end

-- The open turn's undo log (field ul) with `fields` added where not logged yet, each
-- with its value now (values[i], false or nil when absent): what a rollback restores
-- ('\31<field>\30<value>' each; values hold no control characters). `fresh`: the log
-- is new (begin_turn), nothing to look up. Returns the log, for the caller's HSET.
local function journal(ul, fields, values, fresh)
  ul = ul or ''
  local parts = {}
  for i = 1, #fields do
    local f = fields[i]
    if fresh or not string.find(ul, '\31' .. f .. '\30', 1, true) then
      parts[#parts + 1] = '\31' .. f .. '\30' .. (values[i] or '')
    end
  end
  return ul .. table.concat(parts)
end

-- The free room (field fr): the window less the system prompt, the tool framing, the
-- output reserve `out` and each group's claim, the larger of its active tokens (a_w, a_rm,
-- a_s) and its floor (the scratchpad has none). B holds W, S, T, F_w and F_rm as numbers.
-- With nothing active (0, 0, 0: open, reset) it is the window less the reserved floor.
local function free_room(B, out, a_w, a_rm, a_s)
  return B.W - B.S - B.T - out - math.max(a_w, B.F_w) - math.max(a_rm, B.F_rm) - a_s
end

-- The reserved floor (docs/rules.md#budget-and-claims): the system prompt, the tool
-- framing, both floors and the output reserve `out`, which must not exceed the window
-- (open, and begin_turn for its own output reserve). B as for `free_room`.
local function reserved_floor(B, out)
  return B.S + B.T + B.F_w + B.F_rm + out
end

-- Roll the open turn back (docs/agent.md#a-dead-turn-is-undone): every item the turn
-- added goes, every field its undo log names gets its value from before the turn back
-- (items, reservations, the output reserve, a drift flag), the counters are computed
-- again from the items and reservations, the deliveries it was handed are queued again
-- for the next turn, and its lease ends. What a compaction attempt of the turn counted
-- (failures, escalation) stays: the jobs it enqueued cannot be taken back. The session is then exactly as the turn found it, less what
-- expired meanwhile: it fits, as it did. `dl`: the partition deadline index; `why` is
-- kept in rb. Returns the turn rolled back. One HGETALL: a rollback is not a hot path.
local function rollback(key, dl, sid, why)
  local all = redis.call('HGETALL', key)
  local f = {}
  for i = 1, #all, 2 do f[all[i]] = all[i + 1] end
  local tn = tonumber(f.tn)
  local prior = {}
  for field, was in string.gmatch(f.ul or '', '\31([^\30\31]+)\30([^\31]*)') do
    prior[field] = was
  end
  local dead, set, zrem, zadd = { 'lo', 'le', 'lb', 'lk', 'ul', 'vs', 'vd', 'uo' }, {}, { sid .. '|' .. LEASE }, {}
  -- The outcomes of the turn's calls go: a call sent again is then judged anew (refused
  -- as a call of a turn no longer open, or done once in the turn that sends it), never
  -- told that an effect this rollback undid took place.
  local keys = {}
  for k in string.gmatch(f.uo or '', '(%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x)') do
    for w = 2, 4 do
      local b = string.sub(k, 1, w)
      keys[b] = keys[b] or {}
      keys[b][#keys[b] + 1] = string.sub(k, 3)
    end
  end
  for b, ks in pairs(keys) do
    for _, gen in ipairs({ OUT, OLD }) do
      local src = redis.call('HGET', gen, b)
      if src then
        local kept = src
        for _, k in ipairs(ks) do
          local i, j = string.find(kept, '\30' .. k, 1, true)
          if i then
            local nxt = string.find(kept, '\30', j + 1, true)
            kept = string.sub(kept, 1, i - 1) .. (nxt and string.sub(kept, nxt) or '')
          end
        end
        if kept ~= src then
          if kept == '' then redis.call('HDEL', gen, b) else redis.call('HSET', gen, b, kept) end
          if gen == OUT and BUCKET.b == b then BUCKET.cur = kept end
        end
      end
    end
  end
  for name, val in pairs(f) do
    if prior[name] == nil and string.sub(name, 1, 2) == 'i:' and
        tonumber(string.match(val, '^%d+|(%d+)|')) == tn then
      dead[#dead + 1] = name
      f[name] = nil
    end
  end
  local unordered = false
  for name, was in pairs(prior) do
    local rid = string.match(name, '^r:(.+)$')
    -- an item the turn admitted and then changed was absent before the turn
    if string.sub(name, 1, 2) == 'i:' and tonumber(string.match(was, '^%d+|(%d+)|')) == tn then
      was = ''
    end
    if was == '' then
      if f[name] then dead[#dead + 1] = name end
      f[name] = nil
      if rid then zrem[#zrem + 1] = sid .. '|' .. rid end
    else
      set[#set + 1], set[#set + 2] = name, was
      f[name] = was
      -- (an item of scratchpad, retrieval or recall put back has left the reclaim-order
      -- index: the index is no longer complete, and is built again when next needed)
      if string.match(name, '^i:[srm]:') then unordered = true end
      if rid then
        zadd[#zadd + 1], zadd[#zadd + 2] = string.match(was, '|(%d+)$'), sid .. '|' .. rid
      end
    end
  end
  -- (children's fields whose reservation is not open, closed meanwhile by expiry, while
  -- the log kept them from before the turn: they go with it, and are not put back)
  local orphan = {}
  for name in pairs(f) do
    local rid = string.match(name, '^k:([^|]+)')
    if rid and not f['r:' .. rid] then orphan[name], dead[#dead + 1], f[name] = true, name, nil end
  end
  if next(orphan) then
    local kept = {}
    for i = 1, #set, 2 do
      if not orphan[set[i]] then kept[#kept + 1], kept[#kept + 2] = set[i], set[i + 1] end
    end
    set = kept
  end
  if unordered then dead[#dead + 1] = 'oq' end
  local u, n, v = { w = 0, r = 0, m = 0, s = 0 }, { w = 0, r = 0, m = 0, s = 0 }, { w = 0, r = 0, m = 0, s = 0 }
  local nv = 0
  for name, val in pairs(f) do
    local c = string.match(name, '^i:(%a):')
    if c then
      u[c], n[c] = u[c] + tonumber(string.match(val, '^(%d+)|')), n[c] + 1
    elseif string.sub(name, 1, 2) == 'r:' then
      local rc, est = string.match(val, '^(%a)|(%d+)|')
      v[rc], nv = v[rc] + tonumber(est), nv + 1
    end
  end
  local N = function(x) return tonumber(f[x]) or 0 end
  local a_w, a_rm, a_s = u.w + v.w, u.r + v.r + u.m + v.m, u.s + v.s
  local B = { W = N('W'), S = N('S'), T = N('T'), F_w = N('F_w'), F_rm = N('F_rm') }
  local fr = free_room(B, N('out'), a_w, a_rm, a_s)
  for _, kv in ipairs({ 'fr', fr, 'a_w', a_w, 'a_rm', a_rm, 'a_s', a_s, 'nv', nv, 'rb', tn .. ' ' .. why,
    'qs', cat(f.vs, f.qs), 'qd', cat(f.vd, f.qd) }) do
    set[#set + 1] = kv
  end
  for _, c in ipairs({ 'w', 'r', 'm', 's' }) do
    for _, kv in ipairs({ 'u_' .. c, u[c], 'n_' .. c, n[c], 'v_' .. c, v[c] }) do set[#set + 1] = kv end
  end
  call_each('HDEL', key, dead)
  call_each('HSET', key, set)
  call_each('ZREM', dl, zrem)
  call_each('ZADD', dl, zadd)
  indicate(key, 'rolled_back', 1)
  return tn
end

-- settle and void: the open reservation { c, est, deadline, rec, in_turn, ul, pool }, or
-- nil and the stored reply to send again; fails on a missing session, a stale epoch (checked
-- before the reservation, which a reset drops), a call of a turn that is not open or of
-- no turn while one is (`fence`), or no such reservation. in_turn: the call is of the
-- open turn; ul: that turn's undo log; pool: its children's pool 'k:<id>' (false: none).
local function open_reservation(key, op, fp, epoch, rid, tok)
  local v = redis.call('HMGET', key, 'ep', 'r:' .. rid, 'lo', 'tn', 'ul', 'uo', 'k:' .. rid)
  local again = gate(recorded(op), tonumber(v[1]), op, fp, epoch)
  if again then return nil, again end
  local in_turn = fence(key, v[3], tonumber(v[4]), tok)
  if not v[2] then fail('NORESERVATION', 'reservation ' .. rid .. ' is not open') end
  local c, est, deadline = string.match(v[2], '^(%a)|(%d+)|(%d+)$')
  return { c = c, est = tonumber(est), deadline = tonumber(deadline), rec = v[2], in_turn = in_turn,
    ul = v[5], uo = in_turn and (v[6] or '') or nil, pool = v[7] }
end

-- The fields a reservation's children hold (docs/ceilings.md#parent-and-child-sessions),
-- which go when it closes (settle, void, expire; a reset drops every one): its pool
-- 'k:<id>' (its value as read: `pool`, false or nil when it has none, then nothing is
-- read) and one 'k:<id>|<child>' per child, found with HSCAN MATCH (ids hold no glob
-- character), which stops once it found as many as the pool counts: a scan walks the
-- whole hash at worst. Returns the fields and their values, for the caller's HDEL and
-- undo log.
local function child_fields(key, rid, pool)
  local fields, values = {}, {}
  if not pool then return fields, values end
  fields[1], values[1] = 'k:' .. rid, pool
  local n = tonumber(string.match(pool, '|(%d+)$')) or math.huge
  local seen, cursor = {}, '0'
  repeat
    local page = redis.call('HSCAN', key, cursor, 'MATCH', 'k:' .. rid .. '|*', 'COUNT', 1000)
    cursor = page[1]
    for i = 1, #page[2], 2 do
      local f = page[2][i]
      if not seen[f] then  -- (a scan may return a field twice)
        seen[f] = true
        fields[#fields + 1], values[#values + 1] = f, page[2][i + 1]
      end
    end
  until cursor == '0' or #fields > n
  return fields, values
end

-- Append 'u_<c>', 0, 'n_<c>', 0, 'v_<c>', 0 for every consumer (open, reset).
local function zero_counters(args)
  for _, c in ipairs({ 'w', 'r', 'm', 's' }) do
    for _, p in ipairs({ 'u_', 'n_', 'v_' }) do
      args[#args + 1] = p .. c
      args[#args + 1] = 0
    end
  end
  return args
end

-- HMGET fields: the first nnum are numbers (into H, by name; absent: nil), the rest raw
-- values (into R, in order; false where absent). (A number field holds a number written
-- by a script: + 0 converts it once, where tonumber converts a string twice.)
local function load(key, fields, nnum)
  local v = redis.call('HMGET', key, unpack(fields))
  local H, R = {}, {}
  for i = 1, nnum do
    local x = v[i]
    if x then H[fields[i]] = x + 0 end
  end
  for i = nnum + 1, #fields do R[i - nnum] = v[i] end
  return H, R
end

-- How much a group's claim on the window grows when its active tokens move from
-- a to a + d: claims are max(active, floor), so tokens inside a floor are free.
local function claim_delta(a, d, floor)
  return math.max(a + d, floor) - math.max(a, floor)
end

-- Why `requested` tokens did not fit: floor_protected when the window has that much
-- unclaimed room but it lies inside another consumer's floor, else
-- token_budget_exhausted. Only called on the refusal path.
local function refusal_reason(key, requested)
  local v = redis.call('HMGET', key, 'W', 'S', 'T', 'out', 'a_w', 'a_rm', 'a_s')
  local room = tonumber(v[1]) - tonumber(v[2]) - tonumber(v[3]) - tonumber(v[4]) - tonumber(v[5])
    - tonumber(v[6]) - tonumber(v[7])
  if requested <= room then return 'floor_protected' end
  return 'token_budget_exhausted'
end

-- Append a job for the workers to the partition's stream (KEYS of the caller), in
-- the same atomic step as the state change that needs it (docs/rules.md#jobs-in-the-same-step).
-- Whether the background worker compacts the session (compaction jobs are enqueued for
-- it); an agent-owned session ('ca' = 1) compacts inline and gets no compaction jobs.
local function worker_compacts(key)
  return redis.call('HGET', key, 'ca') ~= '1'
end

-- A compaction job also stamps the session with when it was requested (cq, ms of Redis's
-- clock, from the entry's id), so that a caller waiting for it can tell a worker that is
-- late from no worker at all.
local function enqueue(stream, kind, sid, epoch, op, reason)
  local inc = redis.call('HGET', KEYS[1], 'inc')
  local id = redis.call('XADD', stream, '*', 'kind', kind, 'session', sid, 'epoch', epoch,
    'reason', reason, 'op', op, 'inc', inc or '0')
  if kind == 'compact' then redis.call('HSET', KEYS[1], 'cq', string.match(id, '^%d+')) end
end

-- Record the outcome under its op id in the current generation and write args
-- (field, value, ...) to the session in one HSET. Rarely (generation due, TTL due) it
-- also rotates the outcome generations or refreshes the idle TTL. The work per call
-- does not grow with the session's length; the one bucket it rewrites holds about
-- 1/256 of the outcomes of the last op retention.
-- J: { gz = number, xp = number } and, where the caller knows them already, ttl, ort;
-- J.uo, for a call of the open turn: the turn's op keys (field uo) as read, to which
-- this call's is added, so that a rollback drops the outcomes it undoes. c1, ce, c3: a
-- reply its script coded itself (see `store`).
local function commit(key, now, op, fp, out, args, J, c1, ce, c3)
  local refresh, rotate = now >= J.xp, now >= J.gz
  if refresh or rotate then
    if not J.ttl then
      local m = redis.call('HMGET', key, 'ttl', 'ort')
      J.ttl, J.ort = tonumber(m[1]), tonumber(m[2])
    end
    if rotate then
      if redis.call('EXISTS', OUT) == 1 then
        redis.call('RENAME', OUT, OLD)
        redis.call('PEXPIRE', OLD, J.ort)
      end
      args[#args + 1] = 'gz'
      args[#args + 1] = string.format('%d', now + J.ort)
    end
    if refresh then
      args[#args + 1] = 'xp'
      args[#args + 1] = string.format('%d', now + math.floor(J.ttl / 10))
    end
  end
  store(fp, out, rotate, c1, ce, c3)
  if J.uo then
    args[#args + 1], args[#args + 2] = 'uo', J.uo .. string.sub(BUCKET.h, 1, 16)
  end
  if #args > 0 then redis.call('HSET', key, unpack(args)) end
  if refresh then redis.call('PEXPIRE', key, J.ttl) end
  if refresh or rotate then redis.call('PEXPIRE', OUT, J.ttl) end
  return out
end

-- The end of a turn, as end_turn and finish_turn judge it: the turn's amplification
-- class, whether it makes a compaction due (enqueued when the worker compacts), its drift
-- from the real prompt of `final` tokens, and its commit: the lease, undo log and
-- deliveries go (HDEL, and the lease's ZREM from KEYS[3]; KEYS[2] the jobs stream), the
-- session fields it writes are appended to `args`. `a_s` is the scratchpad's occupancy
-- (finish_turn's after its tool results). Returns the reply's pieces, for table.concat.
local function turn_end(key, H, a_s, final, trend, turn, mark, sid, op, args)
  local ratio = math.floor(H.ai * 1000 / final)
  local util = math.floor(final * 1000 / H.W)
  local delta = H.pu < 0 and 0 or util - H.pu
  local class = 'ambiguous'
  if ratio > H.amp and delta < 0 and trend > 0 then
    class = 'pathological'
  elseif delta > 0 and ratio < H.ams then
    class = 'saturation'
  elseif ratio > H.amf then
    class = 'fragmentation'
  end
  local occ = H.S + H.T + H.a_w + H.a_rm + a_s
  local due = (occ > H.HW or H.cd == 1) and 1 or 0
  local drift, tol = final - occ, H.dt or -1
  local flag = 'none'
  if final > H.W then
    flag = 'over_window'
  elseif tol >= 0 and math.abs(drift) > tol then
    flag = 'drift'
  end
  if flag ~= 'none' then indicate(key, 'drift', 1) end
  local wm_budget = H.F_w > 0 and H.F_w or H.W
  local rollup = (H.tn - H.kt > H.rut or H.a_w * 1000 > H.rup * wm_budget) and 1 or 0
  indicate(key, 'class:' .. class, 1)
  if due == 1 and H.cd ~= 1 and worker_compacts(key) then
    enqueue(KEYS[2], 'compact', sid, H.ep, op, 'high_water_mark')
  end
  -- The turn commits: its lease, undo log and deliveries go.
  redis.call('HDEL', key, 'lo', 'le', 'lb', 'lk', 'ul', 'vs', 'vd', 'uo')
  redis.call('ZREM', KEYS[3], sid .. '|' .. LEASE)
  for _, kv in ipairs({ 'pu', util, 'cd', due, 'te', turn, 'dp', final, 'dr', drift, 'df',
      flag == 'none' and 0 or 1 }) do
    args[#args + 1] = kv
  end
  if due == 1 and H.cd ~= 1 then args[#args + 1], args[#args + 2] = 'pm', 0 end
  if mark ~= '-' then args[#args + 1], args[#args + 2] = 'cm', mark end
  return { 'status=ok|turn=', H.tn, '|ratio=', ratio, '|class=', class,
    '|utilization=', util, '|utilization_delta=', delta, '|spans=', H.an, '|span_input=', H.ai,
    '|compaction_due=', due, '|rollup=', rollup, '|epoch=', H.ep, '|occupancy=', occ, '|drift=', drift,
    '|tolerance=', tol, '|flag=', flag }
end

-- Write fields of one of the session's data hashes (its content store, its summaries:
-- KEYS of the calling script) and give it the session's idle TTL (read from the session
-- hash `key` once per call, kept in J).
local function put(dkey, kv, J, key)
  if #kv == 0 then return end
  if not J.ttl then
    local m = redis.call('HMGET', key, 'ttl', 'ort')
    J.ttl, J.ort = tonumber(m[1]), tonumber(m[2])
  end
  redis.call('HSET', dkey, unpack(kv))
  redis.call('PEXPIRE', dkey, J.ttl)
end

-- key=value pairs joined by '|': the one reply shape of every script.
local function reply(kv)
  return table.concat(kv, '|')
end

-- A hard reset's effect (reset.lua, and a turn's end applying a staged one, see
-- `reset_staged`): the epoch advances and every item and reservation goes (a reservation's
-- children's fields 'k:' too), keeping the budget (system prompt, framing and floors); the
-- compaction state (pending, consecutive failures, escalation) starts over; an open turn
-- ends with it (its lease, undo log and deliveries go, and 'rb' names it: its later calls
-- get TURNLOST), and so does a staged reset ('rz'). K: { deadlines, content, summaries } keys (the content store and the
-- summaries are deleted: no item is left, nothing to deliver). Writes everything but the
-- session fields it appends to `args` (field, value, ...: the caller's HSET or commit).
-- Returns the new epoch, the items dropped and the tokens released.
local function reset_effect(key, K, sid, reason, args)
  local H, R = load(key, { 'ep', 'tn', 'W', 'S', 'T', 'out', 'F_w', 'F_rm', 'lo', 'qs', 'qd', 'rz' }, 8)
  local fr = free_room(H, H.out, 0, 0, 0)  -- (before the first write: it reads every floor)
  local all = redis.call('HGETALL', key)
  local dead, members, dropped, released = {}, {}, 0, 0
  for i = 1, #all, 2 do
    local f = all[i]
    local kind = string.sub(f, 1, 2)
    if kind == 'i:' then
      dead[#dead + 1] = f
      dropped = dropped + 1
      released = released + tonumber(string.match(all[i + 1], '^(%d+)|'))
    elseif kind == 'r:' then
      dead[#dead + 1] = f
      members[#members + 1] = sid .. '|' .. string.sub(f, 3)
      released = released + tonumber(string.match(all[i + 1], '^%a|(%d+)|'))
    elseif kind == 'k:' then
      dead[#dead + 1] = f  -- (a reservation's children go with it)
    end
  end
  -- (only fields that exist: a script's first write decides whether it may run on a
  -- server out of memory, and resetting an empty session must not bypass that check)
  if R[1] then for _, f in ipairs({ 'lo', 'le', 'lb', 'lk', 'ul', 'vs', 'vd', 'uo' }) do dead[#dead + 1] = f end end
  if R[2] then dead[#dead + 1] = 'qs' end
  if R[3] then dead[#dead + 1] = 'qd' end
  if R[4] then dead[#dead + 1] = 'rz' end
  call_each('HDEL', key, dead)
  if R[1] then members[#members + 1] = sid .. '|' .. LEASE end
  call_each('ZREM', K[1], members)
  indicate(key, 'resets', 1)
  redis.call('DEL', K[2], K[3])  -- (after a write that may be refused on a full server)
  for _, kv in ipairs({ 'ep', H.ep + 1, 'fr', fr, 'nv', 0, 'a_w', 0, 'a_rm', 0, 'a_s', 0,
      'x:last_reset', reason, 'cd', 0, 'kf', 0, 'kr', 0, 'rq', 0, 'kt', H.tn, 'ai', 0, 'ao', 0, 'an', 0,
      'df', 0, 'dr', 0 }) do
    args[#args + 1] = kv
  end
  zero_counters(args)
  if R[1] then args[#args + 1], args[#args + 2] = 'rb', H.tn .. ' reset' end  -- (its calls: TURNLOST)
  return H.ep + 1, dropped, released
end

-- A staged hard reset (field rz as read, `rz`; docs/rules.md#a-reset-waits-for-the-turns-end):
-- { ep, due, fp, op, reason } when it is one of epoch `ep`, else nil (none, or one an
-- older release's reset left behind: a reset of another epoch is no reset of this one).
local function reset_staged(rz, ep)
  local e, due, fp, op, why = string.match(rz or '', '^(%d+)|(%d+)|(%x+)|([^|]+)|(.+)$')
  if not e or tonumber(e) ~= ep then return nil end
  return { ep = ep, due = tonumber(due), fp = fp, op = op, reason = why }
end

-- At a turn's end (end_turn, finish_turn, abort_turn: after the call's own effects were
-- committed; begin_turn: after the open turn ended or was rolled back): the staged reset
-- `st` (from `reset_staged`, nil: none) applies now, when no turn is open any more. K as
-- for `reset_effect`. Writes it all; returns the new epoch, or nil when none applied.
local function reset_at_end(key, st, K, sid)
  if not st or redis.call('HEXISTS', key, 'lo') == 1 then return nil end
  local args = {}
  local e = reset_effect(key, K, sid, st.reason, args)
  call_each('HSET', key, args)
  return e
end

-- reserve and settle: judge `grow` more tokens, `d` more of their group's claim on the
-- window (H: the caller's load, with fr, ep and tn; `requested`: what the reply names).
-- `pending`: the tokens are memory's and a compaction is pending; they are then judged
-- as admit.lua judges memory (the compaction credit): refused while the last compaction
-- failed to reach H (failed, did_not_fit, stale; not a deferral), else while HW + pm +
-- grow + the output reserve > W, a refusal counted as refused_pending with
-- |bound=|baseline=.
-- Else it is refused when d is more than the free room (the reason `refusal_reason`
-- gives). A refusal is counted and committed as the call's outcome: returns that reply.
-- Else returns nil and pm (the memory admitted since the compaction became pending, for
-- the caller to grow; nil when none is pending).
local function refuse_growth(key, pending, grow, d, H, requested, now, op, fp, J)
  local reason, extra, pm
  if pending then
    local x = load(key, { 'HW', 'out', 'W', 'kf', 'pm', 'kr' }, 6)
    pm = x.pm or 0
    -- (after a deferral the compaction reached H: the post-compaction bound, not 'failed')
    local bound = ((x.kf or 0) > 0 and x.kr ~= x.kf) and 'failed' or 'pending'
    if bound == 'failed' or grow > x.W - x.out - x.HW - pm then
      reason, extra = 'compaction_pending', { 'bound=' .. bound, 'baseline=' .. (x.HW + pm) }
      indicate(key, 'refused_pending', 1)
    end
  end
  if not reason and d > H.fr then reason = refusal_reason(key, grow) end
  if not reason then return nil, pm end
  indicate(key, 'refused', 1)
  local out = { 'status=refused', 'reason=' .. reason, 'requested=' .. requested, 'free=' .. H.fr,
    'epoch=' .. H.ep, 'turn=' .. H.tn }
  for _, kv in ipairs(extra or {}) do out[#out + 1] = kv end
  return commit(key, now, op, fp, reply(out), {}, J)
end

-- A compaction's session numbers (compact.lua, and begin_turn.lua landing a staged one):
-- the first fields of its `load`, the items' records after them.
local COMPACT_NUM = { 'ep', 'tn', 'sq', 'W', 'S', 'T', 'out', 'F_w', 'F_rm', 'a_w', 'a_rm', 'a_s', 'u_w',
  'u_r', 'u_m', 'u_s', 'n_w', 'n_r', 'n_m', 'n_s', 'HW', 'kf', 'kn', 'cx', 'rq', 'gz', 'xp', 'kg', 'cd', 'oq' }

-- A compaction's replaced items, each '<c>:<id>' or '<c>:<id>|<seq>' (c in wrms; seq: only
-- the version admitted with that sequence number): { c, id, ref = '<c>:<id>', ver }, in
-- order. Fails with BADARG on a malformed one or one named twice.
local function plan_refs(list)
  local seen, refs = {}, {}
  for k = 1, #list do
    local raw = type(list[k]) == 'string' and list[k] or ''
    local body, ver = string.match(raw, '^(.-)|(%d+)$')
    local c, id = string.match(body or raw, '^([wrms]):(.+)$')
    if not c then
      fail('BADARG', 'replaced item must be <c>:<id> or <c>:<id>|<seq> with c in wrms, got ' .. show(raw))
    end
    id = id_arg(id, 'item id')
    if ver then ver = int_arg(ver, 'sequence number', 1, 1e15, id) end
    local ref = c .. ':' .. id
    if seen[ref] then fail('BADARG', 'item ' .. id .. ' of ' .. consumer_name(c) .. ' appears twice') end
    seen[ref] = true
    refs[k] = { c = c, id = id, ref = ref, ver = ver }
  end
  return refs
end

-- Whether each replaced item is held at the version given (recs: their records, false
-- where not held): an item held in another version is not the one the compactor read.
local function plan_matched(refs, recs)
  local matched = {}
  for k = 1, #refs do
    local sq = string.match(recs[k] or '', '^%d+|%d+|%d+|(%d+)$')
    matched[k] = recs[k] and (not refs[k].ver or tonumber(sq) == refs[k].ver) or false
  end
  return matched
end

-- The tokens of the session's items admitted after sequence number `read` (the newest
-- item the compactor read), but those in `dead`: what the compaction could not have
-- summarized. One HSCAN of the session's items: once per compaction, not per turn.
local function added_after(key, read, dead)
  local skip, later, cursor = {}, 0, '0'
  for _, f in ipairs(dead) do skip[f] = true end
  local seen = {}
  repeat
    local page = redis.call('HSCAN', key, cursor, 'MATCH', 'i:*', 'COUNT', 4096)
    cursor = page[1]
    for i = 1, #page[2], 2 do
      local f, rec = page[2][i], page[2][i + 1]
      if not seen[f] and not skip[f] then
        seen[f] = true
        local t, sq = string.match(rec, '^(%d+)|%d+|%d+|(%d+)$')
        if t and tonumber(sq) > read then later = later + tonumber(t) end
      end
    end
  until cursor == '0'
  return later
end

-- The effect of a compaction and its judgement (docs/rules.md#compaction-credit), for
-- compact.lua and for begin_turn.lua landing a staged one. H: the session's COMPACT_NUM
-- numbers; recs, matched: the replaced items' records and `plan_matched`. P: { refs,
-- sum_id, sum_t, text, read (the newest sequence number the compactor read, or nil: the
-- items admitted after it are not held against the post-condition), strict (a staged plan:
-- an item not held at its version, or conflict, the summary id held and not replaced,
-- fails the whole plan: outcome stale, nothing replaced), in_turn, ul (a
-- compaction of the open turn: logged for its rollback, no deliveries queued, no texts
-- removed), job (a worker's job), sid, op, now, J }. K: { jobs, content, sums } keys.
-- Writes the content store, the summaries, the job stream and the tally; returns the
-- session's fields to write (for the caller's HSET or commit) and the judgement
-- { outcome, occ, dropped, sum_t, missing, kf, escalate, fr, gain }.
local function compaction_effect(key, H, recs, matched, P, K)
  local A = { a_w = H.a_w, a_rm = H.a_rm, a_s = H.a_s }
  local U = { w = H.u_w, r = H.u_r, m = H.u_m, s = H.u_s }
  local N = { w = H.n_w, r = H.n_r, m = H.n_m, s = H.n_s }
  local sum_t, dropped, dead, was, gone, missing = P.sum_t, 0, {}, {}, {}, {}
  for k, ref in ipairs(P.refs) do
    if matched[k] then
      local t = tonumber(string.match(recs[k], '^(%d+)|'))
      dropped = dropped + t
      A[ACTIVE[ref.c]], U[ref.c], N[ref.c] = A[ACTIVE[ref.c]] - t, U[ref.c] - t, N[ref.c] - 1
      dead[#dead + 1] = 'i:' .. ref.ref
      was[#dead], gone[#dead] = recs[k], ref.ref
    else
      missing[#missing + 1] = ref.ref
    end
  end
  A.a_w = A.a_w + sum_t
  local fr = free_room(H, H.out, A.a_w, A.a_rm, A.a_s)
  -- A summary that does not fit cannot be applied (that would over-allocate), nor a staged
  -- plan whose items changed since it was made: a failed compaction with no effect.
  local stale = P.strict and (#missing > 0 or P.conflict)
  local fits = fr >= 0 and not stale
  if not fits then
    A = { a_w = H.a_w, a_rm = H.a_rm, a_s = H.a_s }
    U = { w = H.u_w, r = H.u_r, m = H.u_m, s = H.u_s }
    N = { w = H.n_w, r = H.n_r, m = H.n_m, s = H.n_s }
    fr = free_room(H, H.out, A.a_w, A.a_rm, A.a_s)
    dead, was, gone, dropped, sum_t = {}, {}, {}, 0, 0
  end
  local occ = H.S + H.T + A.a_w + A.a_rm + A.a_s
  local gain = H.S + H.T + H.a_w + H.a_rm + H.a_s - occ
  -- judged on what is left of the history the compactor read
  local judged = occ - ((fits and P.read) and added_after(key, P.read, dead) or 0)
  local deferred = fits and judged <= H.HW and gain < (H.kg or 0)  -- bought too little: a deferral
  -- rule: post-condition (the demo's rule tests replace the next line)
  local ok = fits and judged <= H.HW and not deferred
  -- no failure counts past an escalation, until the reset
  local kf = ok and 0 or (H.rq == 0 and H.kf + 1 or H.kf)
  local escalate = (not ok) and kf >= H.cx and H.rq == 0
  -- A deferral landed at or under H: it counts toward the escalation (kf) like a failure,
  -- but its baseline holds. Memory is judged on the post-compaction bound after it (kr = kf,
  -- not the `failed` bound), and no compaction is pending after it, nor retried: the next
  -- end_turn above H makes the next one due (docs/rules.md#compaction-credit).
  local landed = deferred and not ok
  if #dead > 0 then redis.call('HDEL', key, unpack(dead)) end
  local sq, args = H.sq, {}
  if sum_t > 0 then
    sq = sq + 1
    args = { 'i:w:' .. P.sum_id, table.concat({ sum_t, H.tn, 1000, sq }, '|') }
    U.w, N.w = U.w + sum_t, N.w + 1
    -- (a working-memory item has no entry in the reclaim-order index: it stays complete)
    if H.oq == H.sq then args[#args + 1], args[#args + 2] = 'oq', sq end
  end
  local upd = { 'sq', sq, 'a_w', A.a_w, 'a_rm', A.a_rm, 'a_s', A.a_s, 'fr', fr, 'kf', kf,
    'cd', (ok or landed) and 0 or 1, 'kr', landed and kf or 0 }
  for _, c in ipairs({ 'w', 'r', 'm', 's' }) do
    upd[#upd + 1], upd[#upd + 2], upd[#upd + 3], upd[#upd + 4] = 'u_' .. c, U[c], 'n_' .. c, N[c]
  end
  for i = 1, #upd do args[#args + 1] = upd[i] end
  if P.in_turn then
    if #dead > 0 then args[#args + 1], args[#args + 2] = 'ul', journal(P.ul, dead, was) end
  elseif #dead > 0 or sum_t > 0 then
    -- Deliveries for the next turn: the summary and what it replaced, except a summary not
    -- delivered yet, which leaves the queue (the items it replaced are queued already).
    local pending = {}
    for id in string.gmatch(P.qs or '', '[^,]+') do pending[id] = true end
    local drops = {}
    for _, ref in ipairs(gone) do
      local wid = string.match(ref, '^w:(.+)$')
      if wid and pending[wid] then pending[wid] = nil else drops[#drops + 1] = ref end
    end
    local keep = {}
    for id in string.gmatch(P.qs or '', '[^,]+') do if pending[id] then keep[#keep + 1] = id end end
    if sum_t > 0 then keep[#keep + 1] = P.sum_id end
    args[#args + 1], args[#args + 2] = 'qs', table.concat(keep, ',')
    args[#args + 1], args[#args + 2] = 'qd', cat(P.qd, table.concat(drops, ','))
  end
  if ok then
    args[#args + 1], args[#args + 2], args[#args + 3], args[#args + 4] = 'kn', H.kn + 1, 'kt', H.tn
  elseif H.rq == 0 then
    indicate(key, 'failed_compactions', 1)
  end
  if fits and not P.in_turn and #gone > 0 then
    redis.call('HDEL', K.content, unpack(gone))
    local olds = {}
    for _, ref in ipairs(gone) do olds[#olds + 1] = string.match(ref, '^w:(.+)$') end
    if #olds > 0 then redis.call('HDEL', K.sums, unpack(olds)) end
  end
  if P.text and sum_t > 0 then
    local quoted = {}
    for i, ref in ipairs(gone) do quoted[i] = '"' .. ref .. '"' end  -- ids need no escapes
    put(K.sums, { P.sum_id, '{"text":' .. cjson.encode(P.text) .. ',"replaced":[' ..
      table.concat(quoted, ',') .. '],"at":' .. string.format('%d', P.now) .. ',"tokens":' ..
      sum_t .. '}' }, P.J, key)
    put(K.content, { 'w:' .. P.sum_id, P.text }, P.J, key)
  end
  if escalate then
    enqueue(K.jobs, 'hard_reset', P.sid, H.ep, P.op, 'failed_compactions')
    indicate(key, 'escalations', 1)
    args[#args + 1], args[#args + 2] = 'rq', 1
  elseif not ok and not landed and H.rq == 0 and worker_compacts(key) and (P.job or H.cd ~= 1) then
    -- (an agent's own failed compaction while a job is queued already adds no second one)
    enqueue(K.jobs, 'compact', P.sid, H.ep, P.op, 'failed_compaction')
  end
  local outcome = ok and 'compacted' or (deferred and 'deferred' or (fits and 'failed' or
    (stale and 'stale' or 'did_not_fit')))
  return args, { outcome = outcome, occ = occ, dropped = dropped, sum_t = sum_t, missing = missing,
    kf = kf, escalate = escalate, fr = fr, gain = gain }
end

-- Budget scopes above the session (docs/ceilings.md). A scope is a tenant, or a key or
-- user within it ('<tenant>/<name>'); a session '@<tenant>/<id>' lives in its tenant's
-- partition, so its scopes' keys share the session's hash tag. Each scope is two keys:
-- its hash '<tag>:t:<scope>' (its configuration, one counter per quantity and bucket,
-- and its open holds 'q:<session>|<reservation>') and its holds index '<tag>:th:<scope>'
-- (a sorted set of the holds' deadlines, ms of Redis's clock). The quantities: i input
-- tokens, o output tokens, c cached input tokens, $ money in micro-cents (a price is
-- cents per million tokens, so tokens x price is micro-cents, an integer).
local SCOPE_Q = { 'i', 'o', 'c', '$' }

-- A whole number as Redis and the replies spell it (Lua's tostring gives 1e+15).
local function num(v)
  return string.format('%d', v)
end

-- ARGV[at] the number of scopes (1..3), then their names: the session's tenant first,
-- then scopes within it. Returns the names, the KEYS suffixes they name (for key_arg:
-- hash, then holds index, per scope) and the index of the last ARGV read.
local function scope_args(at, sid)
  local tenant = string.match(sid, '^@([%w%._:=#%+%-]+)/.')
  if not tenant then
    fail('BADARG', 'session ' .. show(sid) .. ' names no tenant (@<tenant>/<id>): it has no scopes')
  end
  local n = int_arg(ARGV[at], 'scope count', 1, 3)
  local names, suffixes = {}, {}
  for k = 1, n do
    local s = id_arg(ARGV[at + k], 'scope')
    local inside = string.sub(s, 1, #tenant + 1) == tenant .. '/' and #s > #tenant + 1
    if (k == 1 and s ~= tenant) or (k > 1 and not inside) then
      fail('BADARG', 'scope ' .. k .. ' must be ' .. (k == 1 and 'the tenant ' or 'within the tenant ') ..
        tenant .. ', got ' .. show(s))
    end
    for j = 1, k - 1 do
      if names[j] == s then fail('BADARG', 'scope ' .. s .. ' appears twice') end
    end
    names[k], suffixes[2 * k - 1], suffixes[2 * k] = s, 't:' .. s, 'th:' .. s
  end
  return names, suffixes, at + n
end

-- ARGV[at], ARGV[at + 1], ARGV[at + 2]: a call's input, output and cached input tokens,
-- each 0..TOKENS_MAX written canonically (as int_arg checks them; `what` prefixes their
-- names in a refusal: '' or 'billed '), read with one match of the three joined. Returns
-- { i = , o = , c = , text = '<i>|<o>|<c>' }.
local function scope_tokens(at, what)
  local a, b, c = ARGV[at], ARGV[at + 1], ARGV[at + 2]
  if c then
    local text = a .. '|' .. b .. '|' .. c
    local i, o, cc = string.match(text, '^(%d+)|(%d+)|(%d+)$')
    -- (no leading zero but on '0' itself: one number, one spelling)
    if i and not string.find(text, '^0%d') and not string.find(text, '|0%d') then
      i, o, cc = tonumber(i), tonumber(o), tonumber(cc)
      if i <= TOKENS_MAX and o <= TOKENS_MAX and cc <= TOKENS_MAX then
        return { i = i, o = o, c = cc, text = text }
      end
    end
  end
  local t = { i = int_arg(a, what .. 'input tokens', 0, TOKENS_MAX),
    o = int_arg(b, what .. 'output tokens', 0, TOKENS_MAX),
    c = int_arg(c, what .. 'cached input tokens', 0, TOKENS_MAX) }
  t.text = a .. '|' .. b .. '|' .. c
  return t
end

-- key_arg(i, lead, <the scopes' suffixes>) for a scoped call, without formatting each
-- name (no suffix here holds '%s'); the same check, and key_arg's refusal.
local function scope_key_arg(i, lead, suffixes)
  local tag = string.match(KEYS[1] or '', '^([^{]*{p%d+}):s:.')
  local n = #suffixes
  local ok = tag ~= nil and #KEYS == i + n + 3 and KEYS[i] == tag .. ':' .. lead
  for k = 1, n do
    if not ok then break end
    ok = KEYS[i + k] == tag .. ':' .. suffixes[k]
  end
  if not ok then key_arg(i, lead, unpack(suffixes)) end
end

-- The scope fields cf and w are packed with Lua's struct (little-endian signed 64-bit
-- integers, -1 for none): cf '<L><G><hl><input><output><cached input><tokens><money>' then
-- one byte, the kinds the token ceiling counts (1 input, 2 output, 4 cached input); w
-- '<live bucket><i><o><c><$><open holds><next deadline>'. One HMGET and one unpack a scope.
local SCOPE_CF, SCOPE_W = '<i8i8i8i8i8i8i8i8B', '<i8i8i8i8i8i8i8'

-- Each scope's configuration and live counters, one HMGET a scope (KEYS from `first`:
-- hash, then holds index, per scope), checked against a hold of `lease` ms; with `model`,
-- its price from the tenant's (the first scope's) table 'p:<model>', else 'p:*' (read only
-- then), as
-- { i, o, c } cents per million tokens and its text ({ 0, 0, 0 } and '0|0|0' when none:
-- then no scope may have a money ceiling). The live bucket's counters are w, older
-- buckets' '<bucket>:<q>'. Fails NOSCOPE for a scope never set, VERSION for one set by
-- protocol 2 (no cf: set_scope again moves its counters into w), BADARG for a lease above
-- a hold limit or a money ceiling with no price.
local function scope_config(names, first, lease, model)
  local S, money = {}, false
  for k = 1, #names do
    local s, hk = names[k], KEYS[first + 2 * k - 2]
    local v
    if model and k == 1 then v = redis.call('HMGET', hk, 'cf', 'w', 'p:' .. model)
    else v = redis.call('HMGET', hk, 'cf', 'w') end
    if not v[1] then
      if redis.call('HEXISTS', hk, 'L') == 1 then
        fail('VERSION', 'stored layout mismatch: the scope ' .. s .. ' is of layout 2, these scripts are ' ..
          'of protocol ' .. VERSION .. ' and read scopes of layout 3: run set_scope for it again (its ' ..
          'counters are kept) (docs/ceilings.md)')
      end
      fail('NOSCOPE', 'scope ' .. s .. ' has no ceilings set (set_scope)')
    end
    local L, G, hl, ci, co, cc, ct, cm, kf = struct.unpack(SCOPE_CF, v[1])
    if lease and lease > hl then
      fail('BADARG', 'lease ' .. lease .. ' ms is above the hold limit ' .. hl .. ' ms of scope ' .. s)
    end
    local wb, wi, wo, wc, wm, wn, nd = -1, 0, 0, 0, 0, 0, NEVER
    if v[2] then wb, wi, wo, wc, wm, wn, nd = struct.unpack(SCOPE_W, v[2]) end
    S[k] = { name = s, hk = hk, zk = KEYS[first + 2 * k - 1], L = L, G = G, hl = hl, ci = ci, co = co,
      cc = cc, ct = ct, cm = cm, kf = kf, nd = nd, wb = wb >= 0 and wb or nil,
      w = { i = wi, o = wo, c = wc, ['$'] = wm, n = wn }, dirty = false,
      price = model and k == 1 and (v[3] or redis.call('HGET', hk, 'p:*')) or nil }
    money = money or cm >= 0
  end
  if not model then return S end
  local raw = S[1].price
  local pi, po, pc = string.match(raw or '', '^(%d+)|(%d+)|(%d+)$')
  if not pi and money then
    fail('BADARG', 'no price for model ' .. show(model) .. ' in the price table of tenant ' .. S[1].name)
  end
  if not pi then return S, { 0, 0, 0, '0|0|0' } end
  return S, { tonumber(pi), tonumber(po), tonumber(pc), raw }
end

-- The common scoped reserve, read without scope_config's tables: the tenant alone (KEYS[3]
-- its hash), a fixed window, its live counters written, a price of the model itself, a lease
-- within the hold limit. Returns T = { ceilings input, output, cached, tokens, money, kinds,
-- G, live bucket, its i, o, c, $, open holds, next deadline, price i, o, c, price text },
-- or nil: then scope_config reads the scope again and judges all (and refuses what it refuses).
local function scope_fast(lease, model)
  local v = redis.call('HMGET', KEYS[3], 'cf', 'w', 'p:' .. model)
  if not (v[1] and v[2] and v[3]) then return nil end
  local pi, po, pc = string.match(v[3], '^(%d+)|(%d+)|(%d+)$')
  local L, G, hl, ci, co, cc, ct, cm, kf = struct.unpack(SCOPE_CF, v[1])
  if not pi or L ~= G or lease > hl then return nil end
  local wb, wi, wo, wc, wm, wn, nd = struct.unpack(SCOPE_W, v[2])
  return { ci, co, cc, ct, cm, kf, G, wb, wi, wo, wc, wm, wn, nd, tonumber(pi), tonumber(po), tonumber(pc), v[3] }
end

-- Hold `want` in the scope scope_fast read (T) until `deadline` (member m), as scope_sweep,
-- scope_room and scope_hold would, when the live bucket is `now`'s, no hold is due and every
-- ceiling fits: one HSET (the hold and w) and one ZADD. Returns false, having written
-- nothing, in any other case (the general path then judges it).
local function scope_fast_hold(T, now, m, deadline, want)
  local cur = math.floor(now / T[7])
  if T[8] ~= cur or T[14] < now then return false end
  local i, o, c = T[9] + want.i, T[10] + want.o, T[11] + want.c
  local ask = want.i * T[15] + want.o * T[16] + want.c * T[17]
  local money = T[12] + ask
  if (T[1] >= 0 and i > T[1]) or (T[2] >= 0 and o > T[2]) or (T[3] >= 0 and c > T[3]) or
      (T[5] >= 0 and money > T[5]) then
    return false
  end
  if T[4] >= 0 then
    local kf, used = T[6], 0
    if kf % 2 == 1 then used = i end
    if kf % 4 >= 2 then used = used + o end
    if kf >= 4 then used = used + c end
    if used > T[4] then return false end
  end
  redis.call('HSET', KEYS[3], 'q:' .. m, num(cur) .. '|' .. want.text .. '|' .. num(ask) .. '|' ..
    T[18] .. '|1', 'w', struct.pack(SCOPE_W, cur, i, o, c, money, T[13] + 1, math.min(T[14], deadline)))
  redis.call('ZADD', KEYS[4], deadline, m)
  return true
end

-- A scope's live field w as sc holds it.
local function scope_live(sc)
  local w = sc.w
  return struct.pack(SCOPE_W, sc.wb or -1, w.i, w.o, w.c, w['$'], w.n, sc.nd)
end

-- A scope's bucket at `now` (a bucket is G ms; a window is L/G buckets: one for a
-- fixed window, more for a rolling one) and the first bucket still kept: older ones
-- can hold no open hold (a hold lasts at most the scope's hold limit) and are dropped.
local function scope_bucket(sc, now)
  local cur = math.floor(now / sc.G)
  return cur, cur - sc.L / sc.G - math.ceil(sc.hl / sc.G) - 1
end

-- Add d (per quantity, n the hold count) to bucket b's counters: to sc.w when b is the
-- live bucket (written back with w by the caller: sc.dirty), else to the bucket's own fields.
local function scope_add(sc, b, d)
  for q, v in pairs(d) do
    if v ~= 0 then
      if b == sc.wb then
        sc.w[q], sc.dirty = sc.w[q] + v, true
      else
        redis.call('HINCRBY', sc.hk, num(b) .. ':' .. q, num(v))
      end
    end
  end
end

-- Give back the holds of a scope whose deadline has passed on Redis's clock, when one
-- may have (nd, the earliest deadline a hold may have, is past): at most 64 a call, the
-- rest stay counted, which can only refuse, never admit, too much.
local function scope_sweep(sc, now)
  if sc.nd >= now then return end
  local due = redis.call('ZRANGEBYSCORE', sc.zk, '-inf', now - 1, 'LIMIT', 0, 64)
  if #due > 0 then
    local f = {}
    for j, m in ipairs(due) do f[j] = 'q:' .. m end
    local recs = redis.call('HMGET', sc.hk, unpack(f))
    local _, kept = scope_bucket(sc, now)
    for _, rec in ipairs(recs) do
      local b, i, o, c, m = string.match(rec or '', '^(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|')
      if b and tonumber(b) >= kept then
        scope_add(sc, tonumber(b), { i = -tonumber(i), o = -tonumber(o), c = -tonumber(c),
          ['$'] = -tonumber(m), n = -1 })
      end
    end
    redis.call('HDEL', sc.hk, unpack(f))
    redis.call('ZREM', sc.zk, unpack(due))
  end
  local first = redis.call('ZRANGE', sc.zk, 0, 0, 'WITHSCORES')
  sc.nd = tonumber(first[2]) or NEVER
  redis.call('HSET', sc.hk, 'w', scope_live(sc))
  sc.dirty = false
end

-- What a scope has charged in its window (open holds and billed usage), per quantity.
-- The first ceiling `want` would pass: its quantity's name, its ceiling, what is left
-- under it and what was asked; nil when all fit. A fixed window reads nothing more; a
-- rolling one reads its older buckets' counters.
local function scope_room(sc, now, want)
  local cur = math.floor(now / sc.G)
  local lo = cur - sc.L / sc.G + 1
  local sum = sc.w
  if not (sc.wb and sc.wb >= lo) then sum = { i = 0, o = 0, c = 0, ['$'] = 0 } end
  if lo < cur then
    sum = { i = sum.i, o = sum.o, c = sum.c, ['$'] = sum['$'] }
    local f = {}
    for b = lo, cur do
      if b ~= sc.wb then
        for _, q in ipairs(SCOPE_Q) do f[#f + 1] = num(b) .. ':' .. q end
      end
    end
    local v = redis.call('HMGET', sc.hk, unpack(f))
    for j = 1, #f do
      local q = SCOPE_Q[(j - 1) % 4 + 1]
      sum[q] = sum[q] + (tonumber(v[j]) or 0)
    end
  end
  if sc.ci >= 0 and sum.i + want.i > sc.ci then return 'input', sc.ci, sc.ci - sum.i, want.i end
  if sc.co >= 0 and sum.o + want.o > sc.co then return 'output', sc.co, sc.co - sum.o, want.o end
  if sc.cc >= 0 and sum.c + want.c > sc.cc then return 'cached_input', sc.cc, sc.cc - sum.c, want.c end
  if sc.ct >= 0 then
    local kf, used, asked = sc.kf, 0, 0
    if kf % 2 == 1 then used, asked = sum.i, want.i end
    if kf % 4 >= 2 then used, asked = used + sum.o, asked + want.o end
    if kf >= 4 then used, asked = used + sum.c, asked + want.c end
    if used + asked > sc.ct then return 'tokens', sc.ct, sc.ct - used, asked end
  end
  if sc.cm >= 0 and sum['$'] + want['$'] > sc.cm then return 'money', sc.cm, sc.cm - sum['$'], want['$'] end
  return nil
end

-- A new live bucket `cur` for scope sc: the counters of the one before are kept under its
-- number (in bl, the buckets kept) and buckets past keeping are dropped; sc.w starts at 0.
local function scope_roll(sc, now, cur)
  local _, kept = scope_bucket(sc, now)
  local keep, drop, w = {}, {}, {}
  local bl = redis.call('HGET', sc.hk, 'bl') or ''
  if sc.wb then bl = bl .. ',' .. num(sc.wb) end
  for x in string.gmatch(bl, '%d+') do
    if tonumber(x) >= kept then keep[#keep + 1] = x else
      for _, q in ipairs({ 'i', 'o', 'c', '$', 'n', 'ui', 'uo', 'uc', 'u$', 'xt', 'x$' }) do
        drop[#drop + 1] = x .. ':' .. q
      end
    end
  end
  if #drop > 0 then redis.call('HDEL', sc.hk, unpack(drop)) end
  if sc.wb and sc.wb >= kept then
    for _, q in ipairs({ 'i', 'o', 'c', '$', 'n' }) do w[#w + 1], w[#w + 2] = num(sc.wb) .. ':' .. q, num(sc.w[q]) end
  end
  w[#w + 1], w[#w + 2] = 'bl', table.concat(keep, ',')
  redis.call('HSET', sc.hk, unpack(w))
  sc.w, sc.wb = { i = 0, o = 0, c = 0, ['$'] = 0, n = 0 }, cur
end

-- Hold `want` in each scope's current bucket until `deadline` (member m), after every
-- scope said yes: one HSET (the hold and w) and one ZADD a scope (and `scope_roll` when
-- the bucket is new).
local function scope_hold(S, now, m, deadline, want, price)
  local rec = '|' .. want.text .. '|' .. num(want['$']) .. '|' .. price[4] .. '|' .. #S
  for _, sc in ipairs(S) do
    local cur = math.floor(now / sc.G)
    if sc.wb ~= cur then scope_roll(sc, now, cur) end
    local l = sc.w
    l.i, l.o, l.c, l['$'], l.n = l.i + want.i, l.o + want.o, l.c + want.c, l['$'] + want['$'], l.n + 1
    if deadline < sc.nd then sc.nd = deadline end
    redis.call('HSET', sc.hk, 'q:' .. m, num(cur) .. rec, 'w', scope_live(sc))
    redis.call('ZADD', sc.zk, deadline, m)
  end
end

-- The holds of member m in each scope, read and checked: each must be open and made
-- against as many scopes as named (a settle or void names the reservation's scopes).
-- A hold missing is allowed only when `gone_ok` (its deadline passed: swept already).
local function scope_holds(S, m, gone_ok)
  for _, sc in ipairs(S) do
    local rec = redis.call('HGET', sc.hk, 'q:' .. m)
    if rec then
      local p = {}
      for x in string.gmatch(rec, '%d+') do p[#p + 1] = tonumber(x) end
      if p[9] ~= #S then
        fail('BADARG', 'reservation ' .. m .. ' was charged to ' .. p[9] .. ' scopes, ' .. #S .. ' named')
      end
      sc.hold = p
    elseif not gone_ok then
      fail('BADARG', 'reservation ' .. m .. ' holds nothing in scope ' .. sc.name)
    end
  end
end

-- Close member m's hold in each scope: its bucket's held quantities are replaced by
-- `billed` (nil: a void, nothing billed) and the billed usage is counted as used, in the
-- hold's bucket. Returns the tokens and micro-cents billed past the hold, and the
-- billed micro-cents (of the first scope; the same in every scope).
local function scope_close(S, m, billed)
  local over, over_m, cost = 0, 0, 0
  for k, sc in ipairs(S) do
    local p = sc.hold
    if p then
      local b = num(p[1])
      local bi, bo, bc = 0, 0, 0
      if billed then bi, bo, bc = billed.i, billed.o, billed.c end
      local bm = bi * p[6] + bo * p[7] + bc * p[8]
      scope_add(sc, p[1], { i = bi - p[2], o = bo - p[3], c = bc - p[4], ['$'] = bm - p[5], n = -1 })
      if billed then
        redis.call('HINCRBY', sc.hk, b .. ':ui', num(bi))
        redis.call('HINCRBY', sc.hk, b .. ':uo', num(bo))
        redis.call('HINCRBY', sc.hk, b .. ':uc', num(bc))
        redis.call('HINCRBY', sc.hk, b .. ':u$', num(bm))
        local ot = math.max(bi - p[2], 0) + math.max(bo - p[3], 0) + math.max(bc - p[4], 0)
        local om = math.max(bm - p[5], 0)
        if ot > 0 then
          redis.call('HINCRBY', sc.hk, 'ot', num(ot))
          redis.call('HINCRBY', sc.hk, b .. ':xt', num(ot))
        end
        if om > 0 then
          redis.call('HINCRBY', sc.hk, 'om', num(om))
          redis.call('HINCRBY', sc.hk, b .. ':x$', num(om))
        end
        if k == 1 then over, over_m, cost = ot, om, bm end
      end
      if sc.dirty then
        redis.call('HSET', sc.hk, 'w', scope_live(sc))
        sc.dirty = false
      end
      redis.call('HDEL', sc.hk, 'q:' .. m)
      redis.call('ZREM', sc.zk, m)
    end
  end
  return over, over_m, cost
end
