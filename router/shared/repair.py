"""Keys of the shared namespace that hold another type than kvrouter keeps there.

Anything may write to Redis (``router.shared.remote``). A key of the namespace holding
another type fails every command on it, and a pipeline's result with it: one such key
left alone would stop a replica publishing, reading the stream or sharing its load for
good, and Redis would look unreachable when only that key is wrong. Where a command
meets one, the key is deleted (kvrouter writes it again as its own), counted as a bad
entry of kind ``type`` and logged once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from router.shared.keys import Keys
from router.shared.remote import BadEntries

_SCRIPTS = frozenset({"EVAL", "EVALSHA"})


class KeyRepaired(RedisError):
    """Writes met a key of another type, now deleted: they are to be sent again."""


def is_wrong_type(result: object) -> bool:
    """A command's error for a key of the wrong type (Redis 7 passes it out of scripts)."""
    return isinstance(result, ResponseError) and str(result).startswith("WRONGTYPE")


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
    def __init__(self, client: Redis | RedisCluster, keys: Keys, bad: BadEntries) -> None:
        self._client = client
        self._keys = keys
        self._bad = bad

    async def repair(self, candidates: Iterable[Any]) -> int:
        """Delete those of ``candidates`` that hold another type than kvrouter keeps
        there; how many were."""
        keys = list(dict.fromkeys(k for k in candidates if self._keys.kept_type(k)))
        if not keys:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.type(key)
        types = await pipe.execute()
        wrong = [
            key
            for key, kind in zip(keys, types, strict=True)
            if _name(kind) not in (b"none", self._keys.kept_type(key))
        ]
        if wrong:
            self._bad.skipped("type", wrong[0], len(wrong))
            for key in wrong:  # one at a time: on a cluster, each in its own slot
                await self._client.delete(key)
        return len(wrong)

    async def after(
        self, results: Sequence[Any], keys: Sequence[tuple[Any, ...]] | None
    ) -> tuple[bool, ResponseError | None]:
        """After a pipeline's ``execute(raise_on_error=False)``: whether wrong-typed keys
        its commands met were repaired, and the first other error among its results (a
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
        return (await self.repair(met) > 0 if met else False), other


def _name(kind: object) -> bytes | None:
    if isinstance(kind, str):
        return kind.encode()
    return kind if isinstance(kind, bytes) else None
