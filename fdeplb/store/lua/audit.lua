-- audit.lua: append an audit record that is not a transition (an alarm), joining the audit chain; when the note
-- records a change (a config_changed note's configuration, a withdrawn round request, a repaired member record),
-- write that change in the same atomic step.
-- The call is laid out by fdeplb/store/scripts.py (audit_call), whose AUDIT_KEYS / AUDIT_ARGV name these slots.
--
-- KEYS[1]  audit: stream of the cluster
-- KEYS[2]  audit_head: string, the chain of the newest audit record ("" or missing before the first)
-- KEYS[3]  lease: coordinator lease string (read only when ARGV[1] ~= "")
-- KEYS[4..] the keys the note's change writes (ARGV[4] and ARGV[5] name them by position)
--
-- ARGV[1]  fence: the caller's lease value, or "" (then the record's fence field is "")
-- ARGV[2]  audit: JSON array [field, value, ...] of audit fields; fence, ts_ms and chain are appended here
-- ARGV[3]  chain_order: JSON array of the 1-based pair indexes of the audit record (ARGV[2]'s pairs, then fence,
--          ts_ms) in byte order of their names, sorted by the caller (scripts.py chain_order)
-- ARGV[4]  delete: JSON array of positions in KEYS (from 4 on) deleted after the record is appended ("[]": none)
-- ARGV[5]  hset: JSON array of [position in KEYS (from 4 on), [field, value, ...]] written (HSET) after the
--          deletes ("[]": none); each such key must be a hash or missing (or deleted by ARGV[4])
--
-- Everything is checked before anything is written, and the record is appended before the change is written (an
-- append that fails leaves nothing written): the change never lands without its audit record.
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

local function written(position)
  if type(position) ~= 'number' or position < 4 or position > #KEYS or position % 1 ~= 0 then
    error('audit.lua: ' .. tostring(position) .. ' is not a position of a written key (4..' .. #KEYS .. ')')
  end
  return KEYS[position]
end

local delete, hset, deleted = cjson.decode(ARGV[4]), cjson.decode(ARGV[5]), {}
for i, position in ipairs(delete) do
  delete[i] = written(position)
  deleted[delete[i]] = true
end
for i, entry in ipairs(hset) do
  local key, pairs_ = written(entry[1]), entry[2]
  if type(pairs_) ~= 'table' or #pairs_ == 0 or #pairs_ % 2 ~= 0 then
    return redis.error_reply('audit.lua: hset of ' .. key .. ' is not field, value pairs')
  end
  local kind = redis.call('TYPE', key)['ok']
  if not deleted[key] and kind ~= 'hash' and kind ~= 'none' then
    return redis.error_reply('audit.lua: ' .. key .. ' holds a ' .. kind .. ', not a hash')
  end
  hset[i] = {key, pairs_}
end

local ts_ms = now_ms()
local n = #fields
fields[n + 1], fields[n + 2], fields[n + 3], fields[n + 4] = 'fence', ARGV[1], 'ts_ms', ts_ms
local id = append_chained(KEYS[1], KEYS[2], fields, order)
for _, key in ipairs(delete) do
  redis.call('DEL', key)
end
for _, entry in ipairs(hset) do
  redis.call('HSET', entry[1], unpack(entry[2]))
end
return {'OK', id, ts_ms}
