-- audit.lua: append an audit record that is not a transition (an alarm), joining the audit chain; for a
-- config_changed note, write the new cluster configuration in the same atomic step.
-- The call is laid out by fdeplb/store/scripts.py (audit_call), whose AUDIT_KEYS / AUDIT_ARGV name these slots.
--
-- KEYS[1]  audit: stream of the cluster
-- KEYS[2]  audit_head: string, the chain of the newest audit record ("" or missing before the first)
-- KEYS[3]  lease: coordinator lease string (read only when ARGV[1] ~= "")
-- KEYS[4]  config: hash, the cluster configuration (written only when ARGV[4] names fields)
--
-- ARGV[1]  fence: the caller's lease value, or "" (then the record's fence field is "")
-- ARGV[2]  audit: JSON array [field, value, ...] of audit fields; fence, ts_ms and chain are appended here
-- ARGV[3]  chain_order: JSON array of the 1-based pair indexes of the audit record (ARGV[2]'s pairs, then fence,
--          ts_ms) in byte order of their names, sorted by the caller (scripts.py chain_order)
-- ARGV[4]  config: JSON array [field, value, ...] of configuration fields HSET into KEYS[4] after the record is
--          appended ("[]": none), so the configuration never changes without its audit record
--
-- chain: lua/_chain.lua's append_chained (put before this script by scripts.py), as in commit.lua.
-- Returns {"OK", audit_stream_id, ts_ms}, or {"ERR_FENCE", detail} with nothing written.

local refused = fence_refused(KEYS[3], ARGV[1])
if refused then
  return refused
end

local fields = cjson.decode(ARGV[2])
local order = cjson.decode(ARGV[3])
if #order * 2 ~= #fields + 4 then
  return redis.error_reply('audit.lua: chain_order names ' .. #order .. ' fields, the audit record has ' ..
    (#fields / 2 + 2))
end

local config = cjson.decode(ARGV[4])
if #config % 2 ~= 0 then
  return redis.error_reply('audit.lua: config holds ' .. #config .. ' items, not field, value pairs')
end

local ts_ms = now_ms()
local n = #fields
fields[n + 1], fields[n + 2], fields[n + 3], fields[n + 4] = 'fence', ARGV[1], 'ts_ms', ts_ms
local id = append_chained(KEYS[1], KEYS[2], fields, order)
if #config > 0 then
  redis.call('HSET', KEYS[4], unpack(config))
end
return {'OK', id, ts_ms}
