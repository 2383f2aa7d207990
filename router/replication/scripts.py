"""The server-side scripts of the shared state, and how to read their replies.

Each touches keys of one namespace only, which share a hash tag, so they run on a
Redis Cluster too.
"""

from __future__ import annotations

from typing import Any, NamedTuple

# KEYS[1]: each worker's last purged engine start; KEYS[2]: the worker's residency set.
# ARGV: worker, engine start time, TTL (ms). Wipes the set for the first purge of a
# restart only: a replica that noticed the restart later must not wipe what the others
# added after it.
PURGE_ONCE = """
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]))
if last and (last ~= last or last == math.huge) then
    last = nil  -- not a start time: something else wrote it
end
if last and last >= tonumber(ARGV[2]) then
    return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('DEL', KEYS[2])
return 1
"""

# KEYS[1]: the event stream. Returns {entries ever added, entries kept, last id},
# read at one instant ({0, 0, '0-0'} when there is no stream; entries ever added is -1
# before Redis 7, which does not count them).
STREAM_POSITION = """
if redis.call('EXISTS', KEYS[1]) == 0 then
    return {0, 0, '0-0'}
end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local fields = {}
for i = 1, #info, 2 do
    fields[info[i]] = info[i + 1]
end
return {fields['entries-added'] or -1, fields['length'], fields['last-generated-id']}
"""


class StreamPosition(NamedTuple):
    added: int  # entries ever added to the stream (-1: this Redis does not count them)
    kept: int  # entries still on it (the oldest are trimmed)
    last_id: str

    @classmethod
    def from_reply(cls, reply: Any) -> StreamPosition:
        added, kept, last_id = reply
        if isinstance(last_id, bytes):
            last_id = last_id.decode()
        return cls(int(added), int(kept), last_id)

    def missed(self, read: int) -> bool:
        """A reader that has read the stream's first ``read`` entries (counted in
        entries ever added) lost some: unread entries were trimmed, or the stream was
        made anew (Redis lost it)."""
        if self.added < 0:
            return False
        return self.added - self.kept > read or self.added < read


# KEYS[1]: the session's binding (a key nobody writes when the request has no session
# key); then each candidate worker's residency set and reservations, in turn. ARGV[1]:
# now (ms); the rest: the request's chain of block members, head first. Returns the
# worker the session is bound to (false: none), then, per worker, how many leading
# blocks it holds or has reserved (unlapsed) and whether its residency set exists (1/0).
# A worker's blocks form a prefix of a chain (a set is trimmed tail first), so each is
# found by binary search: about 13 lookups per worker for a 100K-token prompt.
LONGEST_PREFIXES = """
local now = tonumber(ARGV[1])
local n = #ARGV - 1
local out = {redis.call('GET', KEYS[1])}
for w = 2, #KEYS, 2 do
    local residency, reserved = KEYS[w], KEYS[w + 1]
    local lo, hi = 0, n
    while lo < hi do
        local mid = math.floor((lo + hi + 1) / 2)
        local m = ARGV[mid + 1]
        local held = redis.call('ZSCORE', residency, m)
        if not held then
            local lapses = redis.call('ZSCORE', reserved, m)
            held = lapses and tonumber(lapses) > now
        end
        if held then lo = mid else hi = mid - 1 end
    end
    out[#out + 1] = lo
    out[#out + 1] = redis.call('EXISTS', residency)
end
return out
"""
