"""The Redis side of ``kvrouter bench fuzz``: a router whose shared state others write to.

Each generated case (``bench.fuzz.redis_inputs``) is written to the router's Redis from
the fuzz's own thread; what it wrote expires (or is taken back) within ``MAX_TTL_MS``, so
the keyspace stays bounded over a long run and the router must come back to health each
time. Meanwhile normal multi-turn traffic must keep getting 200s. Afterwards the router
must have counted what it skipped, per kind, and no sync loop may have failed.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis

from bench.fuzz.client import RawRequest
from bench.fuzz.redis_inputs import LATER, MAX_TTL_MS, NOW, Command, RedisCase
from router.replication.keys import Keys
from router.wire.headers import SESSION_HEADER

SESSIONS = 8
# The router's own keys a case adds to but never expires: it would take the router's
# state with it (the stream, the replicas' register). An overwrite may still hit them.
_KEPT = (b":events", b":replicas")


@dataclass(slots=True)
class RedisTally:
    cases: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)  # commands Redis itself refused
    overwrites: int = 0


class RedisWriter:
    """Applies cases with a plain client; takes back, on a later call, what it cannot
    leave to a TTL (members it added to the replicas' register)."""

    def __init__(self, url: str, namespace: str) -> None:
        # Large writes (a 100,000-member set) on a busy machine: patience, not failure.
        self._client = redis.Redis.from_url(url, socket_timeout=120)
        self._keys = Keys(namespace)
        self._pattern = f"kvr:{{{namespace}}}:*"
        self._undo: deque[tuple[float, Command]] = deque()
        self.tally = RedisTally()

    def close(self) -> None:
        self._client.close()

    def apply(self, case: RedisCase) -> None:
        self._take_back(time.monotonic())
        self.tally.cases += 1
        self.tally.kinds.update(case.kinds)
        for command in case.commands:
            try:
                self._one(command)
            except redis.ResponseError as exc:
                self.tally.refused[str(exc).split(" ")[0]] += 1
            except redis.RedisError as exc:  # the harness's own trouble: counted, run on
                self.tally.refused[type(exc).__name__] += 1

    def finish(self) -> None:
        self._take_back(float("inf"))

    def _one(self, command: Command) -> None:
        if command[0] == "OVERWRITE":
            self._overwrite(command[1])
            return
        now = time.time()
        args = [now if a == NOW else now + 1e9 if a == LATER else a for a in command]
        self._client.execute_command(*args)  # type: ignore[no-untyped-call]
        key = command[1]  # a key is never a score
        if not _as_bytes(key).endswith(_KEPT):
            self._client.pexpire(key, MAX_TTL_MS)
        elif args[0] == "ZADD" and key == self._keys.replicas:
            members = args[3::2]
            self._undo.append((time.monotonic() + MAX_TTL_MS / 1000, ("ZREM", key, *members)))

    def _overwrite(self, how: str) -> None:
        """One of the router's keys (the first a SCAN finds), replaced."""
        found = self._client.scan(0, match=self._pattern, count=200)[1]
        victims = sorted(k for k in found if isinstance(k, bytes))
        if not victims:
            return
        key = victims[self.tally.overwrites % len(victims)]
        self.tally.overwrites += 1
        self._client.delete(key)
        if how == "string":
            self._client.set(key, b"\xff overwritten")
        elif how == "hash":
            self._client.hset(key, b"x", b"y")
        elif how == "list":
            self._client.rpush(key, b"1")
        elif how == "zset":
            self._client.zadd(key, {b"\x00" * 8: 1.0, b"short": 2.0})
        elif how == "huge":
            self._client.set(key, b"h" * (4 * 1024 * 1024))
        self._client.pexpire(key, MAX_TTL_MS)

    def _take_back(self, now: float) -> None:
        while self._undo and self._undo[0][0] <= now:
            _, command = self._undo.popleft()
            try:  # the register may since have been overwritten with another type
                self._client.execute_command(*command)  # type: ignore[no-untyped-call]
            except redis.ResponseError as exc:
                self.tally.refused[str(exc).split(" ")[0]] += 1

    def metrics_snapshot(self) -> dict[str, Any]:
        return {
            "keys": self._client.dbsize(),
            "used_memory": self._client.info("memory")["used_memory"],
        }


def _as_bytes(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else key


def session_turn(api_key: str, model: str) -> Any:
    """Normal traffic: ``SESSIONS`` conversations in turn, each turn carrying a history
    (so the router asks Redis where it lives when another replica seems live)."""

    def request(n: int) -> RawRequest:
        session, turn = n % SESSIONS, n // SESSIONS
        messages: list[dict[str, str]] = []
        for t in range(turn % 6 + 1):
            messages.append({"role": "user", "content": f"session {session} question {t} " * 20})
            messages.append({"role": "assistant", "content": f"answer {t} " * 20})
        messages.append({"role": "user", "content": "and now?"})
        body = orjson.dumps(
            {"model": model, "messages": messages, "max_tokens": 4, "ignore_eos": True}
        )
        headers = (
            (b"Content-Type", b"application/json"),
            (b"Authorization", b"Bearer " + api_key.encode()),
            (SESSION_HEADER.encode(), b"fuzz-session-%d" % session),
        )
        return RawRequest(b"POST", b"/v1/chat/completions", headers, body)

    return request
