"""Hypothesis strategies for a hostile Redis: what another "replica" (another version of
kvrouter, a person with ``redis-cli``, something that is not kvrouter at all) may leave in
the shared state's keys.

A case is a few writes, each a Redis command: replicas that announce themselves with
names that are not text or are huge, or a thousand at once; load and rate entries that
are not numbers, are negative, infinite or past any count; index changes on the stream
with fields missing, of the wrong size or naming workers nobody has; residency sets and
reservations of the wrong member size or type; a fleet policy that does not parse; and
any key the router already wrote, overwritten with a value of another type. Keys a case
writes expire within ``MAX_TTL_MS``, so the state heals and a long run stays bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import orjson
from hypothesis import strategies as st

from bench.fuzz.inputs import ints, json_values, pick
from router.replication.keys import Keys

Strategy = st.SearchStrategy


Command = tuple[Any, ...]
NOW = "@now"  # a score: the time the case is applied (a live replica's)
LATER = "@later"  # a score far in the future: a replica that never lapses
MAX_TTL_MS = 2_000
HUGE_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class RedisCase:
    commands: tuple[Command, ...]
    kinds: frozenset[str]  # which of the router's readers the case aims at


@cache
def _names() -> Strategy[bytes]:
    return st.one_of(
        ints(0, 10**8).map(lambda n: b"fz-%d" % n),
        st.binary(min_size=1, max_size=16),
        st.just(b"\xff\xfe-not-utf8"),
        st.just(b"r" * 100_000),
    )


@cache
def _numbers() -> Strategy[bytes]:
    text = st.one_of(
        ints(0, 1000).map(str),
        ints(-(2**70), 2**70).map(str),
        st.floats().map(repr),
        pick(["inf", "-inf", "nan", "1e400", "", " 1", "0x10", "١٢"]),
    )
    return text.map(str.encode)


@st.composite
def _load_values(draw: st.DrawFn) -> bytes:
    count = draw(ints(0, 6))
    parts = [draw(_numbers()) for _ in range(count)]
    if draw(ints(0, 9)) == 0:
        return draw(st.binary(max_size=40))
    return b",".join(parts)


@st.composite
def _replica(draw: st.DrawFn, keys: Keys, workers: tuple[str, ...]) -> RedisCase:
    name = draw(_names())
    score = draw(pick([NOW] * 6 + [LATER, 0.0, -1.0, 1e300]))
    commands: list[Command] = [("ZADD", keys.replicas, score, name)]
    load_key = keys.load_prefix.encode() + name
    fields = draw(pick(["workers", "junk", "many", "wrong_type", "none"]))
    if fields == "workers":
        for worker in workers:
            commands.append(("HSET", load_key, worker, draw(_load_values())))
    elif fields == "junk":
        commands.append(("HSET", load_key, draw(st.binary(max_size=20)), draw(_load_values())))
    elif fields == "many":
        pairs = [x for i in range(20_000) for x in (f"w{i}", b"1,1,1,1")]
        commands.append(("HSET", load_key, *pairs))
    elif fields == "wrong_type":
        commands.append(("RPUSH", load_key, b"1,2"))
    rate_key = keys.rate_prefix.encode() + name
    rate = draw(pick(["valid", "junk", "wrong_type", "huge", "none"]))
    if rate == "valid":
        commands.append(("SET", rate_key, draw(_numbers()) + b"," + draw(_numbers())))
    elif rate == "junk":
        commands.append(("SET", rate_key, draw(st.binary(max_size=30))))
    elif rate == "huge":
        commands.append(("SET", rate_key, b"1" * HUGE_BYTES))
    elif rate == "wrong_type":
        commands.append(("HSET", rate_key, b"a", b"b"))
    return RedisCase(tuple(commands), frozenset({"load", "rate"}))


@st.composite
def _crowd(draw: st.DrawFn, keys: Keys) -> RedisCase:
    count = draw(pick([1_000, 50_000]))
    members = [x for i in range(count) for x in (NOW, f"crowd-{i}")]
    return RedisCase((("ZADD", keys.replicas, *members),), frozenset({"replicas"}))


@st.composite
def _stream_entry(draw: st.DrawFn, keys: Keys, workers: tuple[str, ...]) -> RedisCase:
    fields: dict[bytes, Any] = {
        b"r": draw(_names()),
        b"o": draw(pick([b"t", b"f", b"p", b"x", b""])),
        b"w": draw(st.one_of(pick(workers).map(str.encode), _names())),
        b"h": draw(_hash_bytes()),
    }
    if draw(st.booleans()):
        fields[b"s"] = draw(_numbers())
    for name in draw(st.lists(pick(sorted(fields)), max_size=2)):
        fields.pop(name, None)
    if not fields:
        fields[b"z"] = b"1"
    flat = [x for pair in fields.items() for x in pair]
    return RedisCase((("XADD", keys.stream, "*", *flat),), frozenset({"stream"}))


@cache
def _hash_bytes() -> Strategy[bytes]:
    return st.one_of(
        ints(0, 64).map(lambda n: bytes(range(8)) * n),
        st.binary(max_size=30),
        pick([b"\x01" * 8 * 1_000_000, b"\x02" * 9]),
    )


@st.composite
def _residency(draw: st.DrawFn, keys: Keys, workers: tuple[str, ...]) -> RedisCase:
    worker = draw(pick(workers))
    key = draw(pick([keys.residency(worker), keys.reserved(worker)]))
    shape = draw(pick(["members", "odd_members", "many", "wrong_type"]))
    if shape == "wrong_type":
        return RedisCase((("SET", key, b"not a set"),), frozenset({"residency"}))
    members: list[float | bytes]
    if shape == "many":
        members = [x for i in range(100_000) for x in (float(i), i.to_bytes(8, "big"))]
    else:
        size = 8 if shape == "members" else draw(pick([0, 1, 7, 9, 64]))
        items = draw(st.lists(st.binary(min_size=size, max_size=size), min_size=1, max_size=8))
        score = draw(pick([0.0, 1e15, -1e300, 1e300]))
        members = [x for m in items for x in (score, m)]
    return RedisCase((("ZADD", key, *members),), frozenset({"residency"}))


@st.composite
def _policy(draw: st.DrawFn, keys: Keys) -> RedisCase:
    values = {
        b"version": draw(st.one_of(_numbers(), st.binary(max_size=8))),
        b"policy": draw(pick([b"ttft", b"round_robin", b"no-such", b"\xff", b""])),
        b"knobs": draw(st.one_of(json_values().map(_json), st.binary(max_size=20), st.just(b"{}"))),
    }
    drop = draw(st.lists(pick(sorted(values)), max_size=1))
    flat = [x for name, value in values.items() if name not in drop for x in (name, value)]
    return RedisCase((("HSET", keys.policy, *flat),), frozenset({"policy"}))


def _json(value: Any) -> bytes:
    return orjson.dumps(value)


@st.composite
def _restarts(draw: st.DrawFn, keys: Keys, workers: tuple[str, ...]) -> RedisCase:
    worker = draw(pick(workers))
    value = draw(st.one_of(_numbers(), st.binary(max_size=10)))
    return RedisCase((("HSET", keys.restarts, worker, value),), frozenset({"restarts"}))


@st.composite
def _overwrite(draw: st.DrawFn) -> RedisCase:
    """Any key the router wrote (picked when the case is applied) made another type."""
    how = draw(pick(["string", "hash", "list", "zset", "huge", "delete"]))
    return RedisCase((("OVERWRITE", how),), frozenset({"overwrite"}))


def redis_cases(namespace: str, workers: tuple[str, ...]) -> Strategy[RedisCase]:
    keys = Keys(namespace)
    one = st.one_of(
        _replica(keys, workers),
        _replica(keys, workers),
        _stream_entry(keys, workers),
        _stream_entry(keys, workers),
        _residency(keys, workers),
        _policy(keys),
        _restarts(keys, workers),
        _overwrite(),
        _overwrite(),
        ints(0, 49).flatmap(lambda n: _crowd(keys) if n == 0 else _replica(keys, workers)),
    )
    return st.lists(one, min_size=1, max_size=3).map(
        lambda cases: RedisCase(
            tuple(c for case in cases for c in case.commands),
            frozenset(k for case in cases for k in case.kinds),
        )
    )
