-- switch.lua: one safe point of an armed rank: publish the rank's step counter, then read, or fix, the
-- switch step of the change the rank is armed for (a committed swap, a weight clear / update).
-- The call is laid out by fdeplb/store/scripts.py (switch_call), whose SWITCH_KEYS / SWITCH_ARGV name these slots.
--
-- KEYS[1]  rearrange: cluster record hash (holds the switch-step field and the fields that identify the change)
-- KEYS[2]  rank: this rank's record hash (armed and armed_step are written here)
-- KEYS[3..] every rank's record hash, ep_rank order (armed and armed_step are read), then every rank's member
--          record, ep_rank order (a rank whose member record exists and is not ACTIVE is not waited for)
--
-- ARGV[1]  armed: the change this rank is armed for, e.g. "swap:<round>:<plan_id>" or "weights:<request>"
-- ARGV[2]  step: this rank's step counter at this safe point (integer >= 0)
-- ARGV[3]  field: cluster-record field holding the change's switch step (0 or missing = not fixed yet)
-- ARGV[4]  current: JSON array [field, value, ...] of cluster-record fields that hold these values while the
--          change is the cluster's current one (e.g. state SWAPPING, round, plan_id)
-- ARGV[5]  margin: steps added to the largest armed step when the switch step is fixed (integer >= 1)
-- ARGV[6]  withdrawn: JSON array [field, value, ...] of cluster-record fields that hold these values once the change
--          was withdrawn (a weight request cancelled by lua/weights_cancel.lua: weights_cancelled = <request>);
--          "[]" = none. A withdrawn change is refused before anything is written: a late arm never fixes it.
-- ARGV[7]  chunks: JSON array of this rank's chunk layout of the change (the first layer of each chunk, ascending;
--          "[]" = a change applied at one safe point), written to the rank record's armed_chunks
-- ARGV[8]  chunks_field: cluster-record field holding the fixed layout ("" = the change has none)
--
-- The switch step is fixed once, by the first call that finds every rank armed for this change:
-- switch = max(armed_step of every ACTIVE member) + margin; the cluster generation it was fixed under is written to
-- the cluster record's switch_generation. Every armed rank runs this script at every safe point, so a rank
-- whose last call published step s calls again at s + 1 <= switch: no armed rank can pass the switch step unseen.
-- With chunks_field, the same call fixes the layout: the union of every waited-for rank's armed_chunks (each
-- rank's chunks then hold whole chunks of the union: every rank's budget holds), as a JSON array; chunk k of it is
-- applied at step switch + k on every rank (fdeplb/orchestration/safe_points.py).
-- Returns {switch_step, status, layout} (layout: the fixed JSON array, "[]" until fixed or without chunks_field): "fixed" (by this call), "set" (fixed before), "waiting" (a rank is not armed yet;
-- switch_step 0), "gone" (the change is no longer the cluster's current one; switch_step 0; nothing fixed),
-- "cancelled" (the change was withdrawn; switch_step 0; nothing written). weights_cancel.lua refuses to withdraw a
-- change whose switch step is fixed, and both scripts are atomic: of a cancel and the last arm, exactly one wins.

local withdrawn = cjson.decode(ARGV[6])
for i = 1, #withdrawn, 2 do
  if redis.call('HGET', KEYS[1], withdrawn[i]) == withdrawn[i + 1] then
    return {0, 'cancelled', '[]'}
  end
end

redis.call('HSET', KEYS[2], 'armed', ARGV[1], 'armed_step', ARGV[2], 'armed_chunks', ARGV[7])

local current = cjson.decode(ARGV[4])
for i = 1, #current, 2 do
  if redis.call('HGET', KEYS[1], current[i]) ~= current[i + 1] then
    return {0, 'gone', '[]'}
  end
end

local function layout()
  if ARGV[8] == '' then
    return '[]'
  end
  return redis.call('HGET', KEYS[1], ARGV[8]) or '[]'
end

local switch = tonumber(redis.call('HGET', KEYS[1], ARGV[3]) or '0') or 0
if switch > 0 then
  return {switch, 'set', layout()}
end

local top = 0
local starts, seen = {}, {}
local n = (#KEYS - 2) / 2
for i = 3, 2 + n do
  local member = redis.call('HGET', KEYS[i + n], 'state')
  if not member or member == 'ACTIVE' then
    local armed = redis.call('HMGET', KEYS[i], 'armed', 'armed_step', 'armed_chunks')
    if armed[1] ~= ARGV[1] then
      return {0, 'waiting', '[]'}
    end
    top = math.max(top, tonumber(armed[2]) or 0)
    local ok, proposed = pcall(cjson.decode, armed[3] or '[]')
    if ok and type(proposed) == 'table' then
      for _, start in ipairs(proposed) do
        if not seen[start] then
          seen[start] = true
          starts[#starts + 1] = start
        end
      end
    end
  end
end
switch = top + tonumber(ARGV[5])
redis.call('HSET', KEYS[1], ARGV[3], tostring(switch), 'switch_generation',
  redis.call('HGET', KEYS[1], 'generation') or '0')
local fixed = '[]'
if ARGV[8] ~= '' then
  table.sort(starts)
  if #starts > 0 then
    fixed = cjson.encode(starts)
  end
  redis.call('HSET', KEYS[1], ARGV[8], fixed)
end
return {switch, 'fixed', fixed}
