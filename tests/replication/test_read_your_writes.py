"""Replicas that route as one: a session's next turn, sent to another replica the moment
the previous one returned and with no session header, finds its history on the worker
that computed it. Real routers over real HTTP, simulated engines, a real redis-server;
the stream between the replicas is made slower than the turns, so only the request
path's own reads and writes (router.replication.path) can route them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from bench.compare.replicas import redis_figures
from bench.textgen import text_for
from router.apis.request import keyed_by_text, read_request
from router.config import StateConfig
from router.fleet.workers import Worker
from router.index.residency import LocalPrefixIndex
from router.replication.connect import connect
from router.replication.keys import Keys
from router.replication.metrics import PathMetrics
from router.replication.path import SharedPath
from router.replication.remote import BadEntries
from router.replication.repair import Repairs
from tests.conftest import (
    EngineFactory,
    RedisServer,
    RunningRouter,
    router_config,
    serve_router,
)
from tests.router_client import (
    Listening,
    chat_body,
    conversation,
    engines,
    metric,
    post,
    wait_for,
)
from tests.tcp_proxy import tcp_proxy

SESSIONS = 6
TURNS = 4


def replica_config(fleet: Any, url: str, seed: int, **state: Any) -> Any:
    values = {
        "flush_interval_s": 5.0,  # far slower than a turn: the mirrors learn nothing in time
        "load_interval_s": 0.5,
        # Generous: a busy test machine must not turn a lookup into a timeout here (the
        # bound has a test of its own).
        "path_timeout_s": 1.0,
        **state,
    }
    # Seeds of their own, as replicas have: with the same seed, two replicas that saw
    # the same sessions break their ties alike and can agree by chance.
    return router_config(fleet, state=StateConfig(url=url, **values), seed=seed)


async def met(http: aiohttp.ClientSession, *replicas: RunningRouter) -> None:
    """Wait until each replica knows the others are live (the path is idle when alone)."""

    async def known() -> bool:
        counts = [await metric(http, r, "kvrouter_redis_replicas") for r in replicas]
        return all(count == len(replicas) for count in counts)

    await wait_for(known)


@contextlib.asynccontextmanager
async def replica_pair(
    engine_factory: EngineFactory, url: str, **state: Any
) -> AsyncIterator[tuple[RunningRouter, RunningRouter, aiohttp.ClientSession]]:
    """Two replicas over four engines, each aware of the other."""
    async with (
        engines(engine_factory, 4) as fleet,
        serve_router(replica_config(fleet, url, 1, **state)) as a,
        serve_router(replica_config(fleet, url, 2, **state)) as b,
        aiohttp.ClientSession() as http,
    ):
        await met(http, a, b)
        yield a, b, http


async def alternate_turns(
    http: aiohttp.ClientSession, replicas: Sequence[Listening]
) -> list[list[tuple[str, int]]]:
    """Each session's turns, each to the next replica as soon as the last returned;
    (worker, cached tokens) per turn. Half the sessions stream, half do not."""
    seen = []
    for s in range(SESSIONS):
        messages = conversation(f"ryw{s}", 400, 150)
        turns = []
        for turn in range(TURNS):
            replica = replicas[turn % len(replicas)]
            body = chat_body(messages, max_tokens=24, stream=s % 2 == 0)
            result = await post(http, replica.url, body)
            assert result.status == 200, result.raw
            assert result.worker is not None
            turns.append((result.worker, result.cached))
            messages += [
                {"role": "assistant", "content": result.text},
                {"role": "user", "content": text_for(f"ryw{s}-u{turn + 1}", 150)},
            ]
        seen.append(turns)
    return seen


async def test_every_later_turn_finds_its_history_on_the_other_replica(
    engine_factory: EngineFactory, redis_url: str
) -> None:
    async with replica_pair(engine_factory, redis_url) as (a, b, http):
        seen = await alternate_turns(http, [a, b])
        for turns in seen:
            assert len({worker for worker, _ in turns}) == 1, seen
            assert all(cached > 0 for _, cached in turns[1:]), seen
        asked = [
            await metric(http, r, "kvrouter_redis_path_operations_total", op="lookup", result="ok")
            for r in (a, b)
        ]
        # Every turn asks: a later one lands on the replica that did not see the last,
        # and nobody holds a first turn's system prompt.
        assert sum(asked) == SESSIONS * TURNS
        # What `bench replicas` reports: a lookup, a reservation and a record a request.
        figures = await redis_figures(http, [a.url, b.url])
        assert figures["redis_trips"] == 3
        assert figures["redis_timeouts"] == 0  # the bound is 1 s here
        assert 0 < figures["redis_wait_p50"] <= figures["redis_wait_p99"] < 1.0
        # Lookup and reserve wait before forwarding, each at most path_timeout_s (1 s).
        assert 0 < figures["redis_wait_before_forwarding"] <= 2.0


async def test_without_read_your_writes_later_turns_miss(
    engine_factory: EngineFactory, redis_url: str
) -> None:
    """The control: the same traffic on mirrors alone loses sessions, so the test above
    can fail."""
    async with replica_pair(engine_factory, redis_url, read_your_writes=False) as (a, b, http):
        seen = await alternate_turns(http, [a, b])
        missed = [cached for turns in seen for _, cached in turns[1:] if cached == 0]
        assert missed, seen


async def served_past_the_bound(http: aiohttp.ClientSession, slowed: Listening) -> dict[str, float]:
    """Three sessions of two requests (streamed, whole) through a replica whose Redis
    answers late, each served; the path's round trips it gave up on, by operation (none
    may have come back in time)."""
    for s in range(3):
        messages = conversation(f"slow{s}", 300, 100)
        for stream in (True, False):
            result = await post(http, slowed.url, chat_body(messages, max_tokens=8, stream=stream))
            assert result.status == 200, result.raw
    given_up = {}
    for op in ("lookup", "reserve", "record"):
        counts = {
            result: await metric(
                http, slowed, "kvrouter_redis_path_operations_total", op=op, result=result
            )
            for result in ("ok", "timeout", "error")
        }
        assert counts["ok"] == 0, (op, counts)
        given_up[op] = counts["timeout"] + counts["error"]
    return given_up


async def test_a_slow_redis_costs_a_request_at_most_the_bound(
    engine_factory: EngineFactory, redis_server: RedisServer, redis_url: str
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        tcp_proxy(redis_server.port) as proxy,
        serve_router(replica_config(fleet, proxy.url, 1, path_timeout_s=0.005)) as a,
        serve_router(replica_config(fleet, redis_url, 2)) as b,
        aiohttp.ClientSession() as http,
    ):
        await met(http, a, b)
        proxy.delay_s = 0.2  # every Redis reply a fifth of a second late
        # The first of each session's requests asks (nobody holds its system prompt);
        # every request reserves and records; each gave up at the bound and went on.
        assert await served_past_the_bound(http, a) == {"lookup": 3, "reserve": 6, "record": 6}

        # The writes still landed, late, off the requests' paths: every turn recorded,
        # and no reservation left claiming blocks after its request ended.
        async def late() -> bool:
            landed = [
                await metric(http, a, "kvrouter_redis_path_operations_total", op=op, result="late")
                for op in ("reserve", "record")
            ]
            return landed == [6, 6]

        await wait_for(late, timeout_s=10)
        keys, client = Keys(a.config.state.namespace), aioredis.Redis.from_url(redis_url)
        try:
            served = {w.name for w in a.config.workers}

            async def landed() -> bool:
                recorded = {w for w in served if await client.exists(keys.residency(w))}
                reserved = sum([await client.zcard(keys.reserved(w)) for w in served])
                return bool(recorded) and reserved == 0

            await wait_for(landed, timeout_s=10)
        finally:
            await client.aclose()


async def test_a_replica_alone_makes_no_round_trips_on_the_path(
    engine_factory: EngineFactory, redis_url: str
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(replica_config(fleet, redis_url, 1)) as a,
        aiohttp.ClientSession() as http,
    ):
        await met(http, a)
        messages = conversation("alone", 300, 100)
        for _ in range(2):
            result = await post(http, a.url, chat_body(messages, max_tokens=8))
            assert result.status == 200
            messages += [
                {"role": "assistant", "content": result.text},
                {"role": "user", "content": "more"},
            ]
        assert result.cached > 0
        trips = [
            await metric(http, a, "kvrouter_redis_path_operations_total", op=op, result=r)
            for op in ("lookup", "reserve", "record")
            for r in ("ok", "timeout", "error")
        ]
        assert sum(trips) == 0


async def test_a_keyed_session_follows_its_binding_where_the_index_lost_it(
    engine_factory: EngineFactory, redis_url: str
) -> None:
    """The residency sets are trimmed to capacity and expire; the session's binding
    still names the worker that served its last turn."""
    async with replica_pair(engine_factory, redis_url) as (a, b, http):
        client = aioredis.Redis.from_url(redis_url)
        try:
            for s in range(4):
                messages = conversation(f"bound{s}", 400, 150)
                key = f"bound{s}"  # a session key, in the body
                first = await post(http, a.url, chat_body(messages, max_tokens=24, user=key))
                assert first.worker is not None
                await client.delete(f"kvr:{{kvrouter}}:res:{first.worker}")
                messages += [
                    {"role": "assistant", "content": first.text},
                    {"role": "user", "content": "and then?"},
                ]
                second = await post(http, b.url, chat_body(messages, max_tokens=8, user=key))
                assert second.worker == first.worker
                assert second.cached > 0
        finally:
            await client.aclose()


async def test_a_binding_does_not_outvote_the_index_that_saw_the_session_evicted(
    redis_url: str,
) -> None:
    """Where a worker's residency set is kept it is the truth: a session evicted there
    is placed afresh (as one router does), not held to the worker by its binding, which
    pinned evicted sessions to their full worker and piled sessions onto it."""
    local = LocalPrefixIndex()
    workers = [Worker(name, f"http://{name}", 64 * 1000) for name in ("w0", "w1")]
    for w in workers:
        local.add_worker(w.name, 1000)
    handle = connect(redis_url)
    path = SharedPath(
        handle.client, local, StateConfig(url=redis_url), PathMetrics(CollectorRegistry()),
        lambda: True,
    )  # fmt: skip
    raw = orjson.dumps({"model": "m", "messages": conversation("ev", 400, 100), "user": "ev"})
    request = keyed_by_text(read_request("chat", raw), 64)
    hashes = list(request.key.hashes)
    try:
        await path.record(workers[0], hashes, [], request.session_key)
        keys = Keys("kvrouter")
        # The index lost w0's set (expired, say): the binding stands in for it.
        await handle.client.delete(keys.residency("w0"))
        found = await path.lookup(request, hashes, workers)
        assert found is not None and found["w0"] >= request.history_blocks > 0
        # The set is kept and holds other sessions only: w0 evicted this one.
        await handle.client.zadd(keys.residency("w0"), {b"other": 1.0})
        found = await path.lookup(request, hashes, workers)
        assert found == {"w0": 0, "w1": 0}
    finally:
        await path.close()
        await handle.aclose()


async def test_a_response_owner_of_another_type_is_not_found_and_repaired(
    engine_factory: EngineFactory, redis_url: str
) -> None:
    """A hash where the owner of a stored response belongs: the read failed as if Redis
    were away (503, for as long as the key stayed), and nothing deleted it."""
    raw = aioredis.from_url(redis_url)
    key = Keys("kvrouter").response("resp_planted")
    await raw.hset(key, "x", "y")
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(replica_config(fleet, redis_url, 1)) as a,
        aiohttp.ClientSession() as http,
    ):
        async with http.get(f"{a.url}/v1/responses/resp_planted") as response:
            assert response.status == 404, await response.text()

        async def deleted() -> bool:
            return await raw.type(key) == b"none"

        await wait_for(deleted)
        assert await metric(http, a, "kvrouter_redis_bad_entries_total", kind="type") == 1
    await raw.aclose()


@pytest.mark.parametrize("planted", ["rsv", "res"])
async def test_the_paths_writes_repair_a_key_of_another_type(redis_url: str, planted: str) -> None:
    """A reservation or residency key holding a hash failed the path's pipeline, wrapped
    by redis-py ("Command # 1 ... caused error: ('WRONGTYPE ...')"): taken for a plain
    Redis error, counted, and left there for every later request."""
    local = LocalPrefixIndex()
    worker = Worker("w0", "http://w0", 64 * 1000)
    local.add_worker(worker.name, 1000)
    handle = connect(redis_url)
    registry = CollectorRegistry()
    bad = BadEntries(registry)
    keys = Keys("kvrouter")
    repairs = Repairs(handle.client, keys, bad)
    path = SharedPath(
        handle.client, local, StateConfig(url=redis_url, path_timeout_s=1.0),
        PathMetrics(registry), lambda: True, repairs,
    )  # fmt: skip
    key = keys.reserved("w0") if planted == "rsv" else keys.residency("w0")
    await handle.client.hset(key, "x", "y")
    try:
        if planted == "rsv":
            await path.reserve("w0", [1, 2, 3])
        else:
            await path.record(worker, [1, 2, 3], [], "s" * 32)

        async def repaired() -> bool:
            return await handle.client.type(key) != b"hash"

        await wait_for(repaired)
        assert registry.get_sample_value("kvrouter_redis_bad_entries_total", {"kind": "type"}) == 1
    finally:
        await path.close()
        await handle.aclose()
