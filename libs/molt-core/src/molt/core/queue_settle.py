"""How ``TrajectoryQueue``'s reader settles entries: acknowledged, skipped or dead-lettered, each in one
Lua script that runs only while the reader holds its consumer name (``consumer_claim.GUARD`` first).

KEYS after the claim's two: the stream, the skipped-groups set, the dead-letter stream, the skipped
trajectories' counts. ARGV after the
claim's two: the consumer group, then each script's own. In a script, the XDEL and the XACK of an
entry happen together: no state between them is left for a reader to repair.
"""

from __future__ import annotations

from molt.core.consumer_claim import GUARD

# ARGV[4]: '1' to record the entries as skipped (SADD) too; ARGV[5]: k, then k pairs of a drop reason and
# how many trajectories of the entries it dropped, added (HINCRBY) only when the SADD recorded an entry
# not recorded before: a retry whose first try ran, its reply lost, counts nothing twice. Then the entry
# ids. Returns how many were pending. Ids go by a thousand at a time: Lua's unpack takes only so many.
SETTLE_SCRIPT = (
    GUARD
    + """
local first = 6 + 2 * tonumber(ARGV[5])
local settled, recorded = 0, 0
for i = first, #ARGV, 1000 do
  local ids = {unpack(ARGV, i, math.min(i + 999, #ARGV))}
  if ARGV[4] == '1' then recorded = recorded + redis.call('SADD', KEYS[4], unpack(ids)) end
  redis.call('XDEL', KEYS[3], unpack(ids))
  settled = settled + redis.call('XACK', KEYS[3], ARGV[3], unpack(ids))
end
if recorded > 0 then
  for i = 6, first - 1, 2 do redis.call('HINCRBY', KEYS[6], ARGV[i], ARGV[i + 1]) end
end
return settled
"""
)

# ARGV[4]: dead letters kept (about: MAXLEN ~), then the letter's reason, entry id, size and payload.
DEAD_LETTER_SCRIPT = (
    GUARD
    + """
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[4], '*',
  'reason', ARGV[5], 'entry_id', ARGV[6], 'bytes', ARGV[7], 'group', ARGV[8])
redis.call('XACK', KEYS[3], ARGV[3], ARGV[6])
redis.call('XDEL', KEYS[3], ARGV[6])
redis.call('SADD', KEYS[4], ARGV[6])
return 0
"""
)
