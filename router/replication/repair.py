"""Keys of the shared namespace that hold another type than kvrouter keeps there.

Anything may write to Redis (``router.replication.remote``). A key of the namespace holding
another type fails every command on it, and a pipeline's result with it: one such key
left alone would stop a replica publishing, reading the stream or sharing its load for
good, and Redis would look unreachable when only that key is wrong. Where a command
meets one, the key is deleted (kvrouter writes it again as its own), counted as a bad
entry of kind ``type`` and logged once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from router.replication.keys import Keys
from router.replication.remote import BadEntries

_SCRIPTS = frozenset({"EVAL", "EVALSHA"})


# KEYS: the keys to look at; ARGV[i]: the type kvrouter keeps at KEYS[i]. Deletes each
# key holding another type (in one step, so a key another replica has just written
# again as its own is left alone); returns how many it deleted. The keys share the
# namespace's hash tag: one slot on a cluster.
_DELETE_WRONG_TYPES = """
local deleted = 0
for i, key in ipairs(KEYS) do
    local kind = redis.call('TYPE', key).ok
    if kind ~= 'none' and kind ~= ARGV[i] then
        redis.call('DEL', key)
        deleted = deleted + 1
    end
end
return deleted
"""


class KeyRepaired(RedisError):
    """Writes met a key of another type, now deleted: they are to be sent again (a loop
    that meets it pauses briefly and sends again; what it resends is idempotent: touches,
    forgets, and purges that wipe once per restart)."""


def is_wrong_type(result: object) -> bool:
    """A command's error for a key of the wrong type: as Redis says it, out of a script
    (Redis 7), or wrapped by a pipeline that raised it."""
    return isinstance(result, ResponseError) and "WRONGTYPE" in str(result)


def command_keys(args: Sequence[Any]) -> tuple[Any, ...]:
    """The keys a queued command names: a script's declared keys, else its first argument."""
    if not args:
        return ()
    if str(args[0]).upper() in _SCRIPTS and len(args) > 2:
        return tuple(args[3 : 3 + int(args[2])])
    return (args[1],) if len(args) > 1 else ()


def queued_keys(pipeline: Any) -> list[tuple[Any, ...]] | None:
    """Per queued command of a pipeline, the keys it names; None where redis-py keeps
    its queue out of sight. (A plain pipeline's ``command_stack`` holds ``(args,
    options)``; a cluster pipeline's strategy holds commands with ``args``.)"""
    queue = getattr(pipeline, "command_stack", None)
    if queue is None:
        queue = getattr(getattr(pipeline, "_execution_strategy", None), "_command_queue", None)
    if not isinstance(queue, list):
        return None
    return [command_keys(getattr(entry, "args", None) or entry[0]) for entry in queue]


class Repairs:
    def __init__(
        self,
        client: Redis | RedisCluster,
        keys: Keys,
        bad: BadEntries,
        on_repaired: Callable[[], None] = lambda: None,
    ) -> None:
        self._client = client
        self._keys = keys
        self._bad = bad
        self._on_repaired = on_repaired  # what a deleted key held is gone: write it anew

    async def repair(self, candidates: Iterable[Any]) -> int:
        """Delete those of ``candidates`` that hold another type than kvrouter keeps
        there; how many were."""
        kept = {k: kind for k in candidates if (kind := self._keys.kept_type(k)) is not None}
        if not kept:
            return 0
        keys, types = list(kept), list(kept.values())
        deleted = int(await self._client.eval(_DELETE_WRONG_TYPES, len(keys), *keys, *types))
        if deleted:
            self._bad.skipped("type", keys[0], deleted)
            self._on_repaired()
        return deleted

    async def after(
        self, results: Sequence[Any], keys: Sequence[tuple[Any, ...]] | None
    ) -> tuple[bool, ResponseError | None]:
        """After a pipeline's ``execute(raise_on_error=False)``: whether its commands met
        keys of another type (repaired now, here or by whoever got there first: either
        way those commands did nothing), and the first other error among its results (a
        wrong type too, when the commands' keys are not known)."""
        if keys is None or len(keys) != len(results):
            first = next((r for r in results if isinstance(r, ResponseError)), None)
            return False, first
        met = [
            key
            for named, result in zip(keys, results, strict=True)
            if is_wrong_type(result)
            for key in named
        ]
        other = next(
            (r for r in results if isinstance(r, ResponseError) and not is_wrong_type(r)), None
        )
        if met:
            await self.repair(met)
        return bool(met), other
