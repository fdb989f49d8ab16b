-- audit_trim.lua: trim the audit records a coordinator exported (XTRIM MINID), fenced by its lease like its other
-- writes: a paused or deposed coordinator trims nothing.
-- The call is laid out by fdeplb/store/scripts.py (audit_trim_call), whose AUDIT_TRIM_KEYS / AUDIT_TRIM_ARGV name
-- these slots; lua/_chain.lua (put before this script by scripts.py) gives fence_refused.
--
-- KEYS[1]  audit: stream of the cluster
-- KEYS[2]  lease: coordinator lease string (read only when ARGV[1] ~= "")
--
-- ARGV[1]  fence: the caller's lease value, or "" (unfenced)
-- ARGV[2]  minid: the oldest stream id kept (every record below it is trimmed; records appended meanwhile stay)
--
-- Returns {"OK", number of records trimmed}, or {"ERR_FENCE", detail} with nothing trimmed.

local refused = fence_refused(KEYS[2], ARGV[1])
if refused then
  return refused
end
return {'OK', redis.call('XTRIM', KEYS[1], 'MINID', ARGV[2])}
