-- commit.lua: commit one transition of one record atomically, together with its audit record.
-- The call is laid out by fdeplb/store/scripts.py (commit_call), whose COMMIT_KEYS / COMMIT_ARGV name these slots.
--
-- KEYS[1]  record: hash being transitioned (cluster, rank or weights record)
-- KEYS[2]  audit: stream of the cluster
-- KEYS[3]  lease: coordinator lease string (read only when ARGV[3] ~= "")
-- KEYS[4]  rearrange: cluster record hash (cluster_in and withdrawn guards; its 'generation' field: ARGV[11], bump_generation)
-- KEYS[5]  placement: current placement hash (plan_not_current guard, set_placement effect: the plan's
--          new_phy2log and the round's members, KEYS[4]'s 'members', the ranks the placement is routed over)
-- KEYS[6]  plan: plan hash named by the transition's plan_id (plan_stored guard, set_placement effect)
-- KEYS[7]  audit_head: string, the chain of the newest audit record ("" or missing before the first)
-- KEYS[8]  signal: stream the rank agents block on (written only when ARGV[9] is "1")
-- KEYS[9..] rank records / weight records read by per-rank guards, then their member records (ranges in ARGV[7])
--
-- ARGV[1]  expected_state: the state the caller read
-- ARGV[2]  expected_version: the version the caller read (integer, "0" for a fresh record)
-- ARGV[3]  fence: the caller's lease value, or "" for machines that are not fenced
-- ARGV[4]  new_state: the state the transition reaches
-- ARGV[5]  fields: JSON array [field, value, ...] of extra record fields to set (strings)
-- ARGV[6]  audit: JSON array [field, value, ...] of audit fields; version, fence, ts_ms and chain are appended here
-- ARGV[7]  guards: JSON array of {kind, first, count, members, state, states, plan_id} (first/count index KEYS;
--          members: index of the first of count member records, 0 = none: a per-rank guard skips every rank whose
--          member record exists and is not ACTIVE); "[]" = none
-- ARGV[8]  effect: "" or "set_placement" or "bump_generation" (the cluster's generation + 1, also written as the
--          record's 'generation')
-- ARGV[9]  signal: "1" to append {state, round, version} of the record to KEYS[8] (capped), waking the rank
--          agents (a cluster transition into a state where ranks have work), else ""
-- ARGV[10] chain_order: JSON array of the 1-based pair indexes of the audit record (ARGV[6]'s pairs, then
--          version, fence, ts_ms) in byte order of their names, sorted by the caller (scripts.py chain_order)
-- ARGV[11] generation: "" (not fenced by generation) or the cluster generation the caller read; refused with
--          ERR_GENERATION when the stored one is newer (the membership changed since the caller decided)
--
-- An audit pair named 'generation' (its value "" from the caller) is filled with the cluster's generation as
-- this commit leaves it.--
-- chain: lua/_chain.lua's append_chained (the one definition, put before this script by scripts.py) hashes the
--        audit record after KEYS[7]'s chain, in the order ARGV[10] gives, and moves KEYS[7] on.
--
-- Returns {"OK", new_version, audit_stream_id, ts_ms}, or {error_code, detail} with nothing written:
-- ERR_FENCE, ERR_STALE, ERR_GUARD, ERR_GENERATION.

local rec = KEYS[1]
local cur = redis.call('HMGET', rec, 'state', 'version')
local cur_state, cur_version = cur[1], cur[2]
if not cur_state or not cur_version then
  return {'ERR_STALE', 'record ' .. rec .. ' does not exist or has no state/version'}
end

local refused = fence_refused(KEYS[3], ARGV[3])
if refused then
  return refused
end

if cur_state ~= ARGV[1] or cur_version ~= ARGV[2] then
  return {'ERR_STALE', 'expected ' .. ARGV[1] .. ' v' .. ARGV[2] .. ', found ' .. cur_state .. ' v' .. cur_version}
end

local function field_of(key, field)
  local v = redis.call('HGET', key, field)
  if not v then return '' end
  return v
end

local stored_generation = field_of(KEYS[4], 'generation')
local generation = tonumber(stored_generation)
if stored_generation == '' then
  generation = 0
elseif not generation or generation ~= math.floor(generation) or generation < 0 then
  -- a corrupt value would silently disable the generation fence: refuse, nothing written
  return {'ERR_STALE', 'generation of ' .. KEYS[4] .. ' is not a non-negative integer: ' .. stored_generation}
end
if ARGV[11] ~= '' and generation > tonumber(ARGV[11]) then
  return {'ERR_GENERATION', 'made under generation ' .. ARGV[11] .. ', the cluster is at generation ' ..
    generation .. ' (the membership changed)'}
end

local guards = {}
if ARGV[7] ~= '[]' then guards = cjson.decode(ARGV[7]) end
for _, g in ipairs(guards) do
  if g.kind == 'ranks_in' or g.kind == 'weights_in' then
    if g.count == 0 then
      return {'ERR_GUARD', g.kind .. ': no ranks registered'}
    end
    local counted = 0
    for i = g.first, g.first + g.count - 1 do
      local member = ''
      if g.members > 0 then member = field_of(KEYS[g.members + i - g.first], 'state') end
      if member == '' or member == 'ACTIVE' then  -- no member record (a cluster made before membership): counted
        counted = counted + 1
        local got = redis.call('HMGET', KEYS[i], 'state', 'plan_id')
        local st, plan = got[1] or '', got[2] or ''
        if st ~= g.state then
          return {'ERR_GUARD', g.kind .. ': ' .. KEYS[i] .. ' is ' .. st .. ', not ' .. g.state}
        end
        if g.plan_id ~= '' and plan ~= g.plan_id then
          return {'ERR_GUARD', g.kind .. ': ' .. KEYS[i] .. ' holds plan ' .. plan .. ', not ' .. g.plan_id}
        end
      end
    end
    if counted == 0 then
      return {'ERR_GUARD', g.kind .. ': no rank is an ACTIVE member'}
    end
  elseif g.kind == 'cluster_in' then
    local st = field_of(KEYS[4], 'state')
    local ok = false
    for _, s in ipairs(g.states) do
      if s == st then ok = true end
    end
    if not ok then
      return {'ERR_GUARD', 'cluster_in: cluster is ' .. st}
    end
    if g.plan_id ~= '' and field_of(KEYS[4], 'plan_id') ~= g.plan_id then
      return {'ERR_GUARD', 'cluster_in: cluster plan is ' .. field_of(KEYS[4], 'plan_id') .. ', not ' .. g.plan_id}
    end
  elseif g.kind == 'plan_stored' then
    if redis.call('EXISTS', KEYS[6]) == 0 then
      return {'ERR_GUARD', 'plan_stored: ' .. KEYS[6] .. ' does not exist'}
    end
  elseif g.kind == 'plan_not_current' then
    if g.plan_id ~= '' and field_of(KEYS[5], 'plan_id') == g.plan_id then
      return {'ERR_GUARD', 'plan_not_current: plan ' .. g.plan_id .. ' is committed; the round rolls forward'}
    end
  elseif g.kind == 'withdrawn' then
    local req = field_of(rec, 'request')
    if req == '' or req == '0' or field_of(KEYS[4], 'weights_cancelled') ~= req then
      return {'ERR_GUARD', 'withdrawn: weight request ' .. req .. ' of ' .. rec .. ' was not cancelled'}
    end
    if field_of(rec, 'prior') ~= g.state then
      return {'ERR_GUARD', 'withdrawn: ' .. rec .. ' came from ' .. field_of(rec, 'prior') .. ', not ' .. g.state}
    end
  else
    return redis.error_reply('commit.lua: unknown guard kind ' .. tostring(g.kind))
  end
end

local set = cjson.decode(ARGV[5])
local fields = cjson.decode(ARGV[6])
local order = cjson.decode(ARGV[10])
if #order * 2 ~= #fields + 6 then
  return redis.error_reply('commit.lua: chain_order names ' .. #order .. ' fields, the audit record has ' ..
    (#fields / 2 + 3))
end

local ts_ms = now_ms()
local new_version = tostring(tonumber(cur_version) + 1)

if ARGV[8] == 'set_placement' then
  local phy2log = redis.call('HMGET', KEYS[6], 'new_phy2log', 'new_phy2log:dtype', 'new_phy2log:shape', 'plan_id')
  if not phy2log[1] then
    return {'ERR_GUARD', 'set_placement: plan ' .. KEYS[6] .. ' has no new_phy2log'}
  end
  local pver = redis.call('HINCRBY', KEYS[5], 'version', 1)
  redis.call('HSET', KEYS[5], 'phy2log', phy2log[1], 'phy2log:dtype', phy2log[2], 'phy2log:shape', phy2log[3],
    'plan_id', phy2log[4], 'updated_ms', ts_ms, 'members', redis.call('HGET', KEYS[4], 'members') or '')
elseif ARGV[8] == 'bump_generation' then
  generation = redis.call('HINCRBY', KEYS[4], 'generation', 1)
  set[#set + 1], set[#set + 2] = 'generation', tostring(generation)
elseif ARGV[8] ~= '' then
  return redis.error_reply('commit.lua: unknown effect ' .. ARGV[8])
end

redis.call('HSET', rec, 'state', ARGV[4], 'version', new_version, 'updated_ms', ts_ms, unpack(set))
for i = 1, #fields, 2 do
  if fields[i] == 'generation' then fields[i + 1] = tostring(generation) end
end

local n = #fields
fields[n + 1], fields[n + 2], fields[n + 3], fields[n + 4], fields[n + 5], fields[n + 6] =
  'version', new_version, 'fence', ARGV[3], 'ts_ms', ts_ms
local id = append_chained(KEYS[2], KEYS[7], fields, order)
if ARGV[9] == '1' then
  local round = redis.call('HGET', rec, 'round') or '0'
  redis.call('XADD', KEYS[8], 'MAXLEN', '~', '64', '*', 'state', ARGV[4], 'round', round, 'version', new_version)
end
return {'OK', new_version, id, ts_ms}
