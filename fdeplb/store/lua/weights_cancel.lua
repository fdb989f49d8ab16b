-- weights_cancel.lua: withdraw a weight clear / update whose switch step was not fixed in time, together
-- with its audit record: no rank has applied it, so every rank returns to the state it came from (the WEIGHTS
-- table's cancel transitions, guarded by "withdrawn"), and a late arm for it is refused (switch.lua's withdrawn).
-- The call is laid out by fdeplb/store/scripts.py (weights_cancel_call), whose WEIGHTS_CANCEL_KEYS /
-- WEIGHTS_CANCEL_ARGV name these slots.
--
-- KEYS[1]  rearrange: cluster record hash (weights_request, weights_switch_step; weights_cancelled is written)
-- KEYS[2]  audit: stream of the cluster
-- KEYS[3]  audit_head: string, the chain of the newest audit record
-- KEYS[4]  lease: coordinator lease string (read only when ARGV[2] ~= "")
-- KEYS[5]  signal: stream the rank agents block on (one entry: they fire their cancel transitions)
-- KEYS[6..] every rank's weight-status record hash, ep_rank order (state, request, at_switch are read)
--
-- ARGV[1]  request: the weight request to withdraw (integer >= 1, as the cluster record holds it)
-- ARGV[2]  fence: the caller's lease value, or "" (unfenced)
-- ARGV[3]  busy: JSON array of the weight states of a rank carrying a request out (CLEARING, UPDATING)
-- ARGV[4]  held_by: the ranks that held the request back, comma-separated (kept as weights_held_by)
-- ARGV[5]  reason: why, as text (kept as weights_cancel_reason)
-- ARGV[6]  audit: JSON array [field, value, ...] of audit fields; from, to, version, fence, ts_ms and chain are
--          appended here (from = to = the cluster record's state, version its version: a note, not a transition)
-- ARGV[7]  chain_order: JSON array of the 1-based pair indexes of the audit record (ARGV[6]'s pairs, then from, to,
--          version, fence, ts_ms) in byte order of their names, sorted by the caller (scripts.py chain_order)
--
-- Refused, with nothing written, when the request may have been applied somewhere: its switch step is fixed
-- (ERR_SWITCHED: every rank switches at it), a rank carried it out already or carries it out without a switch step
-- (ERR_APPLIED: a threaded agent applies a request at once); and when it is not the cluster's latest request
-- (ERR_GONE) or the fence is not the lease holder (ERR_FENCE). switch.lua fixes a switch step only while the
-- request is not withdrawn, and both scripts are atomic: of a cancel and the last arm, exactly one wins.
-- Returns {"OK", audit_stream_id}, {"ALREADY", ""} (withdrawn before: nothing written), or {error_code, detail}.

local refused = fence_refused(KEYS[4], ARGV[2])
if refused then
  return refused
end

local rec = redis.call('HMGET', KEYS[1], 'state', 'version', 'weights_request', 'weights_switch_step',
  'weights_cancelled')
local n = ARGV[1]
if not rec[1] or not rec[2] then
  return {'ERR_GONE', 'no cluster record at ' .. KEYS[1]}
end
if rec[5] == n then
  return {'ALREADY', ''}
end
if rec[3] ~= n then
  return {'ERR_GONE', 'weight request ' .. n .. ' is not the latest (' .. tostring(rec[3]) .. ')'}
end
local switch = tonumber(rec[4] or '0') or 0
if switch > 0 then
  return {'ERR_SWITCHED', 'weight request ' .. n .. ' switches at step ' .. tostring(switch)}
end

local busy = {}
for _, s in ipairs(cjson.decode(ARGV[3])) do busy[s] = true end
for i = 6, #KEYS do
  local w = redis.call('HMGET', KEYS[i], 'state', 'request', 'at_switch')
  if w[2] == n then
    if not busy[w[1] or ''] then
      return {'ERR_APPLIED', KEYS[i] .. ' carried out weight request ' .. n .. ' (' .. tostring(w[1]) .. ')'}
    end
    if w[3] ~= '1' then
      return {'ERR_APPLIED', KEYS[i] .. ' carries out weight request ' .. n .. ' without a switch step'}
    end
  end
end

local fields = cjson.decode(ARGV[6])
local order = cjson.decode(ARGV[7])
if #order * 2 ~= #fields + 10 then
  return redis.error_reply('weights_cancel.lua: chain_order names ' .. #order .. ' fields, the audit record has ' ..
    (#fields / 2 + 5))
end

redis.call('HSET', KEYS[1], 'weights_cancelled', n, 'weights_held_by', ARGV[4], 'weights_cancel_reason', ARGV[5])
local ts_ms = now_ms()
local m = #fields
fields[m + 1], fields[m + 2], fields[m + 3], fields[m + 4], fields[m + 5] = 'from', rec[1], 'to', rec[1], 'version'
fields[m + 6], fields[m + 7], fields[m + 8], fields[m + 9], fields[m + 10] = rec[2], 'fence', ARGV[2], 'ts_ms', ts_ms
local id = append_chained(KEYS[2], KEYS[3], fields, order)
redis.call('XADD', KEYS[5], 'MAXLEN', '~', '64', '*', 'what', 'weights_cancelled')
return {'OK', id}
