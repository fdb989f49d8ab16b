-- _chain.lua: what every script that appends to the audit stream shares, defined once: the audit chain, the
-- lease-fence check and the server-time stamp. fdeplb/store/scripts.py (script_text) puts this file before each of
-- them (commit.lua, audit.lua, weights_cancel.lua); fdeplb.replay.chain_of is the chain's Python twin, and
-- tests/test_scripts.py pins the two against each other.
--
-- chain = sha1hex(previous chain .. "\n" .. for every other field of the audit record, by name in byte order:
--         name .. "=" .. byte length of value .. ":" .. value .. "\n")
-- The caller sorts the names (scripts.py chain_order) and passes their 1-based pair indexes in that order.

-- The chain of the audit record `fields` ({name, value, name, value, ...}) after `previous`, hashing the pairs in
-- the order `order` gives (1-based pair indexes).
local function audit_chain(previous, fields, order)
  local body = {previous, '\n'}
  for j, i in ipairs(order) do
    local v = fields[2 * i]
    body[j + 2] = fields[2 * i - 1] .. '=' .. #v .. ':' .. v .. '\n'
  end
  return redis.sha1hex(table.concat(body))
end

-- Append `fields` to the audit stream `audit_key` with its chain field (chained after the one `head_key` holds, ""
-- before the first record) and move `head_key` on to it; returns the new entry's stream id. The entry is added
-- before the head moves: an XADD that fails (the key holds another type) leaves the head where it was.
local function append_chained(audit_key, head_key, fields, order)
  local chain = audit_chain(redis.call('GET', head_key) or '', fields, order)
  local n = #fields
  fields[n + 1], fields[n + 2] = 'chain', chain
  local id = redis.call('XADD', audit_key, '*', unpack(fields))
  redis.call('SET', head_key, chain)
  return id
end


-- nil when `fence` is "" (an unfenced caller) or is the lease value `lease_key` holds; else the {"ERR_FENCE",
-- detail} reply the script returns at once, with nothing written.
local function fence_refused(lease_key, fence)
  if fence == '' then
    return nil
  end
  local lease = redis.call('GET', lease_key)
  if lease ~= fence then
    return {'ERR_FENCE', 'fence ' .. fence .. ' is not the lease holder (' .. tostring(lease) .. ')'}
  end
  return nil
end

-- The Redis server's clock in milliseconds since the epoch, as a decimal string (every audit record's ts_ms).
local function now_ms()
  local t = redis.call('TIME')
  return t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
end
