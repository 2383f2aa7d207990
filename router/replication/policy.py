"""The fleet's routing policy in Redis: one small hash, numbered by Redis, the newest wins.

``kvr:{ns}:policy`` holds ``version``, ``policy`` and ``knobs`` (JSON, as given to the
change). ``RedisSync`` drives it:

* a change (``PUT /admin/policy`` on any replica) runs ``CHANGE``: version = max(the stored
  version, the replica's own) + 1, written with the policy in one atomic script, so Redis
  puts all changes in one order and the last to reach it is the newest;
* each replica reads the hash at start (before it serves) and every ``load_interval_s``,
  and installs a version newer than its own (``PolicySlot.install``). The configured
  policy is version 0, so a replica that starts later runs the fleet's policy, not its
  file's; until the first change every replica runs its own configured policy;
* a replica whose policy came from a change writes it back when the hash is gone (Redis
  restarted empty) with ``RESTORE``, which writes only over an older version, so a
  replica starting after that still finds the fleet's policy.

The hash has no TTL: it is one small key, and if it expired a restarted replica would run
its configured policy beside replicas running the changed one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

# A stored version that is not a whole number from 0 to 2^53 (written by something
# else: "nan", "inf", "1e300", "x") counts as 0, so the next change writes a good one.
_STORED = """
local stored = tonumber(redis.call('HGET', KEYS[1], 'version'))
if not stored or stored ~= stored or stored < 0 or stored > 2^53 or stored % 1 ~= 0 then
    stored = 0
end
"""
# KEYS[1]: the hash. ARGV: the replica's own version, policy name, knobs (JSON).
CHANGE = (
    _STORED
    + """
local version = math.max(stored, tonumber(ARGV[1])) + 1
redis.call('HSET', KEYS[1], 'version', version, 'policy', ARGV[2], 'knobs', ARGV[3])
return version
"""
)
# ARGV: the version to restore, policy name, knobs (JSON). 1 if written.
RESTORE = (
    _STORED
    + """
if tonumber(ARGV[1]) <= stored then return 0 end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'policy', ARGV[2], 'knobs', ARGV[3])
return 1
"""
)


@dataclass(frozen=True, slots=True)
class FleetPolicy:
    version: int
    name: str
    knobs: dict[str, Any]


def encode_knobs(knobs: Mapping[str, Any]) -> bytes:
    return orjson.dumps(dict(knobs))


def decode(fields: Mapping[bytes, bytes]) -> FleetPolicy:
    """The stored policy; ValueError if the hash is not one this code wrote."""
    try:
        version, name = int(fields[b"version"]), fields[b"policy"].decode()
        knobs = orjson.loads(fields[b"knobs"])
    except (KeyError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError too
        raise ValueError(f"malformed policy hash: {exc!r}") from exc
    if not isinstance(knobs, dict):
        raise ValueError("malformed policy hash: knobs is not a JSON object")
    return FleetPolicy(version, name, knobs)
