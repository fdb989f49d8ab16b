-- audit.lua: append an audit record that is not a transition (an alarm), joining the audit chain.
-- The call is laid out by fdeplb/store/scripts.py (audit_call), whose AUDIT_KEYS / AUDIT_ARGV name these slots.
--
-- KEYS[1]  audit: stream of the cluster
-- KEYS[2]  audit_head: string, the chain of the newest audit record ("" or missing before the first)
-- KEYS[3]  lease: coordinator lease string (read only when ARGV[1] ~= "")
--
-- ARGV[1]  fence: the caller's lease value, or "" (then the record's fence field is "")
-- ARGV[2]  audit: JSON array [field, value, ...] of audit fields; fence, ts_ms and chain are appended here
--
-- chain: as in commit.lua (sha1hex of the previous chain and the record's other fields, by name in byte order).
-- Returns {"OK", audit_stream_id, ts_ms}, or {"ERR_FENCE", detail} with nothing written.

if ARGV[1] ~= '' then
  local lease = redis.call('GET', KEYS[3])
  if lease ~= ARGV[1] then
    return {'ERR_FENCE', 'fence ' .. ARGV[1] .. ' is not the lease holder (' .. tostring(lease) .. ')'}
  end
end

local t = redis.call('TIME')
local ts_ms = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
local fields = cjson.decode(ARGV[2])
for _, v in ipairs({'fence', ARGV[1], 'ts_ms', ts_ms}) do
  table.insert(fields, v)
end

local function bytes_lt(a, b)  -- byte order, whatever the server's locale (Lua's < uses strcoll)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
local value_of, names = {}, {}
for i = 1, #fields, 2 do
  value_of[fields[i]] = fields[i + 1]
  table.insert(names, fields[i])
end
table.sort(names, bytes_lt)
local body = {redis.call('GET', KEYS[2]) or '', '\n'}
for _, name in ipairs(names) do
  local v = value_of[name]
  table.insert(body, name .. '=' .. #v .. ':' .. v .. '\n')
end
local chain = redis.sha1hex(table.concat(body))
redis.call('SET', KEYS[2], chain)

local xadd = {'XADD', KEYS[1], '*'}
for _, v in ipairs(fields) do
  table.insert(xadd, v)
end
table.insert(xadd, 'chain')
table.insert(xadd, chain)
local id = redis.call(unpack(xadd))
return {'OK', id, ts_ms}
