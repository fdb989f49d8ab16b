-- publish.lua: publish one rank's expert_load window, stamped with the server's clock, and wake the coordinator,
-- in one atomic step (a reader that sees the event sees the window). Laid out by fdeplb/store/scripts.py
-- (publish_call), whose PUBLISH_KEYS / PUBLISH_ARGV name these slots.
--
-- KEYS[1]  load: the rank's load hash (fields replaced: the window's arrays, round, published_ms)
-- KEYS[2]  events: the cluster's events stream (one load_published entry, capped at ARGV[1] entries, approximate)
--
-- ARGV[1]  events_maxlen: the events stream's cap
-- ARGV[2]  ep_rank: the publishing rank (integer text)
-- ARGV[3]  round: the round the window is published for (integer text)
-- ARGV[4..] window: field, value, field, value ... of the encoded window (fdeplb/store/arrays.py; raw bytes)
--
-- Returns published_ms, the server time (ms) written with the window.

local t = redis.call('TIME')
local ms = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
local hset = {'HSET', KEYS[1], 'round', ARGV[3], 'published_ms', ms}
for i = 4, #ARGV do
  table.insert(hset, ARGV[i])
end
redis.call(unpack(hset))
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'kind', 'load_published', 'rank', ARGV[2], 'round', ARGV[3])
return ms
