-- lease.lua: acquire or renew the coordinator lease, with a monotonic fencing counter.
--
-- The call is laid out by fdeplb/store/scripts.py (lease_call), whose LEASE_KEYS / LEASE_ARGV name these slots.
--
-- KEYS[1]  lease: string (value "<fence>:<holder>", expires after ARGV[3] ms)
-- KEYS[2]  fence: counter (INCR on every new acquisition; never decreases, never expires)
-- ARGV[1]  op: "acquire" | "renew" | "release"
-- ARGV[2]  value: holder id (acquire) or the caller's current lease value (renew, release)
-- ARGV[3]  ttl_ms: time to live in ms
--
-- acquire: if nobody holds the lease, take it with a fresh fence; returns the lease value, or false.
-- renew:   if the caller still holds it, push the expiry; returns the value, or false (lease lost).
-- release: if the caller still holds it, delete it; returns 1 or 0.

local cur = redis.call('GET', KEYS[1])
if ARGV[1] == 'acquire' then
  if cur then return false end
  -- a fence that is not a counter (written by someone else) is refused naming the key, before anything changes
  local held = redis.call('GET', KEYS[2])
  if held and not string.match(held, '^%d+$') then
    return redis.error_reply('lease.lua: corrupt fence counter ' .. KEYS[2] .. ' holds ' .. string.format('%q', string.sub(held, 1, 40)) .. ', not a non-negative integer')
  end
  local fence = redis.call('INCR', KEYS[2])
  local value = tostring(fence) .. ':' .. ARGV[2]
  redis.call('SET', KEYS[1], value, 'PX', ARGV[3])
  return value
elseif ARGV[1] == 'renew' then
  if cur ~= ARGV[2] then return false end
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return cur
elseif ARGV[1] == 'release' then
  if cur ~= ARGV[2] then return 0 end
  redis.call('DEL', KEYS[1])
  return 1
end
return redis.error_reply('lease.lua: unknown op ' .. tostring(ARGV[1]))
