"""Changing the routing policy at runtime: PUT/GET /admin/policy, alone and across replicas."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from policies.base import Decision, Outcome, RouteRequest, WorkerView
from policies.registry import policy_names
from policies.round_robin import RoundRobinPolicy
from router.apis.request import parse_request
from router.config import RouterConfig
from router.config_loader import load_config
from router.errors import ConfigError
from router.fleet.workers import Fleet, Worker
from router.index.residency import LocalPrefixIndex
from router.observability.metrics import RouterMetrics
from router.replication.keys import Keys
from router.routing.dispatch import Router
from router.routing.policy_slot import ActivePolicy, PolicySlot
from tests.conftest import (
    EngineFactory,
    RedisServer,
    RunningEngine,
    RunningRouter,
    router_config,
    serve_router,
)
from tests.fleet.test_admin import AUTH, TOKEN, admin
from tests.replication.test_shared_state import fast_sync
from tests.router_client import (
    assert_idle,
    chat_body,
    conversation,
    engines,
    held_stream,
    metric,
    post,
    router_samples,
    wait_for,
)

POLICY_READS = "kvrouter_redis_operation_seconds_count"
TTFT_DEFAULTS = {
    "cache_weight": 1.0,
    "temperature": 0.0,
    "eviction_weight": 0.0,
    "return_weight": 0.0,
    "tie_tolerance": 0.2,
    "ties_spare_returns": False,
    "spread_first_turns": True,
    "subagents_with_parent": False,
    "count_offloaded": False,
    "spread_reloads": True,
}


async def policy_of(http: aiohttp.ClientSession, router: RunningRouter) -> dict[str, Any]:
    status, body = await admin(http, router, "GET", "/admin/policy")
    assert status == 200
    return dict(body)


async def workers_served(
    http: aiohttp.ClientSession, router: RunningRouter, key: str, n: int = 4
) -> list[str | None]:
    """Where ``n`` copies of one prompt went, one after another: ttft keeps them where the
    first left its cache, round robin rotates them."""
    body = chat_body(conversation(key, 400, 50), max_tokens=2)
    return [(await post(http, router.url, body)).worker for _ in range(n)]


async def info_series(
    http: aiohttp.ClientSession, router: RunningRouter
) -> dict[tuple[str, str], float]:
    return {
        (labels["policy"], labels["knobs"]): value
        for name, labels, value in await router_samples(http, router)
        if name == "kvrouter_policy_info"
    }


# -- one router ----------------------------------------------------------------------------


async def test_the_next_request_is_routed_by_the_new_policy(engine_factory: EngineFactory) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet, admin_token=TOKEN)) as router,
        aiohttp.ClientSession() as http,
    ):
        assert len(set(await workers_served(http, router, "before"))) == 1
        held = chat_body(conversation("held", 50, 50), max_tokens=200)
        async with held_stream(http, router.url, held) as (response, _):
            status, body = await admin(
                http, router, "PUT", "/admin/policy", {"policy": "round_robin"}
            )
            assert status == 200
            assert body == {"policy": "round_robin", "knobs": {}, "version": 1}
            # The request in flight when the policy changed finishes as it started.
            assert (await response.read()).rstrip().endswith(b"data: [DONE]")
        assert set(await workers_served(http, router, "after")) == {"w0", "w1"}
        assert await policy_of(http, router) == body
        assert (
            await metric(http, router, "kvrouter_routing_decisions_total", policy="round_robin")
            == 4
        )
        await assert_idle(http, router, wait_s=2)


async def test_bad_changes_are_refused_and_change_nothing(engine_factory: EngineFactory) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, admin_token=TOKEN)) as router,
        aiohttp.ClientSession() as http,
    ):
        status, body = await admin(http, router, "PUT", "/admin/policy", {"policy": "nope"})
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["param"] == "policy"
        message = body["error"]["message"]
        assert message.endswith("known policies: " + ", ".join(policy_names()))
        with pytest.raises(ConfigError) as from_config:  # the config file's own words
            load_config(flags={"policy": "nope"}, environ={})
        assert str(from_config.value) == f"policy: {message}"

        for change, param, words in (
            ({"policy": "ttft", "knobs": {"cache_wieght": 2}}, "knobs", "no knob 'cache_wieght'"),
            ({"knobs": {"cache_weight": -1}}, "knobs", "cache_weight must be >= 0"),
            ({"knobs": {"cache_weight": "heavy"}}, "knobs", "cache_weight must be a number"),
            ({"policy": "session", "knobs": {"load_factor": 0.5}}, "knobs", "load_factor"),
            ({"knobs": [2.0]}, "knobs", "'knobs' must be an object"),
            ({"policy": 3}, "policy", "'policy' must be a string"),
            ({"polcy": "ttft"}, "polcy", "unknown field 'polcy'"),
            ({}, None, "give 'policy', 'knobs' or both"),
        ):
            status, body = await admin(http, router, "PUT", "/admin/policy", change)
            assert status == 400, change
            assert body["error"]["param"] == param and words in body["error"]["message"], body
        with pytest.raises(ConfigError) as from_config:
            load_config(
                flags={"policy": "ttft", "policy_knobs": {"cache_weight": "heavy"}}, environ={}
            )
        assert str(from_config.value) == (
            "policy: policy 'ttft': cache_weight must be a number, got 'heavy'"
        )
        async with http.put(router.url + "/admin/policy", data=b"{", headers=AUTH) as response:
            assert response.status == 400

        for method in ("GET", "PUT"):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                status, body = await admin(
                    http,
                    router,
                    method,
                    "/admin/policy",
                    {"policy": "round_robin"},
                    headers=headers,
                )
                assert status == 401 and body["error"]["type"] == "authentication_error"

        assert await policy_of(http, router) == {
            "policy": "ttft",
            "knobs": TTFT_DEFAULTS,
            "version": 0,
        }
        assert await metric(http, router, "kvrouter_policy_changes_total") == 0


async def test_metrics_and_the_workers_listing_show_the_policy(
    engine_factory: EngineFactory,
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet, admin_token=TOKEN)) as router,
        aiohttp.ClientSession() as http,
    ):
        assert await info_series(http, router) == {
            (
                "ttft",
                "cache_weight=1.0,count_offloaded=False,eviction_weight=0.0,return_weight=0.0,spread_first_turns=True,spread_reloads=True,subagents_with_parent=False,temperature=0.0,tie_tolerance=0.2,ties_spare_returns=False",
            ): 1
        }
        status, body = await admin(
            http, router, "PUT", "/admin/policy", {"policy": "ttft", "knobs": {"cache_weight": 2.0}}
        )
        assert status == 200
        assert body == {
            "policy": "ttft",
            "knobs": {
                "cache_weight": 2.0,
                "temperature": 0.0,
                "eviction_weight": 0.0,
                "return_weight": 0.0,
                "tie_tolerance": 0.2,
                "ties_spare_returns": False,
                "spread_first_turns": True,
                "subagents_with_parent": False,
                "count_offloaded": False,
                "spread_reloads": True,
            },
            "version": 1,
        }
        assert await info_series(http, router) == {
            (
                "ttft",
                "cache_weight=2.0,count_offloaded=False,eviction_weight=0.0,return_weight=0.0,spread_first_turns=True,spread_reloads=True,subagents_with_parent=False,temperature=0.0,tie_tolerance=0.2,ties_spare_returns=False",
            ): 1
        }  # the old series is gone
        assert await metric(http, router, "kvrouter_policy_changes_total") == 1

        # Knobs alone: the same policy, those knobs over its defaults (cache_weight resets).
        status, body = await admin(
            http, router, "PUT", "/admin/policy", {"knobs": {"temperature": 0.5}}
        )
        assert status == 200
        assert body == {
            "policy": "ttft",
            "knobs": {
                "cache_weight": 1.0,
                "temperature": 0.5,
                "eviction_weight": 0.0,
                "return_weight": 0.0,
                "tie_tolerance": 0.2,
                "ties_spare_returns": False,
                "spread_first_turns": True,
                "subagents_with_parent": False,
                "count_offloaded": False,
                "spread_reloads": True,
            },
            "version": 2,
        }
        status, listing = await admin(http, router, "GET", "/admin/workers")
        assert status == 200 and listing["policy"] == body
        assert [w["name"] for w in listing["workers"]] == ["w0", "w1"]
        assert await metric(http, router, "kvrouter_policy_changes_total") == 2


# -- plain values --------------------------------------------------------------------------


class RecordingPolicy(RoundRobinPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.chose: list[str] = []
        self.completed: list[str] = []

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> Decision:
        decision = super().choose(request, candidates)
        self.chose.append(decision.worker)
        return decision

    def on_complete(self, request: RouteRequest, worker: str, outcome: Outcome) -> None:
        self.completed.append(worker)


def plain_router() -> tuple[Router, PolicySlot, RouterMetrics]:
    fleet, index = Fleet(), LocalPrefixIndex()
    for name in ("a", "b"):
        fleet.add(Worker(name, f"http://{name}", 64_000))
        index.add_worker(name, 1000)
    metrics = RouterMetrics(fleet, index, 64)
    slot = PolicySlot("ttft", {}, 1, metrics)
    return Router(fleet, index, slot, 64, metrics), slot, metrics


def test_a_request_in_flight_finishes_with_the_policy_that_chose_it() -> None:
    router, slot, _ = plain_router()
    request = parse_request(
        "chat",
        orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}),
        256,
    )
    route = router.route_request(request, "r")
    first, second = RecordingPolicy(), RecordingPolicy()
    assert slot.install(ActivePolicy("round_robin", {}, 1, first))
    in_flight = router.dispatch(request, route, [])
    assert slot.install(ActivePolicy("round_robin", {}, 2, second))
    after = router.dispatch(request, route, [])
    in_flight.finish("success", ())
    after.finish("success", ())
    assert first.chose == first.completed == [in_flight.worker.name]
    assert second.chose == second.completed == [after.worker.name]


def test_only_a_newer_version_is_installed() -> None:
    _, slot, metrics = plain_router()
    assert slot.install(slot.build("least_load", {"token_weight": 8}, 3))
    assert not slot.install(slot.build("round_robin", {}, 2))  # older news arrives late
    assert not slot.install(slot.build("round_robin", {}, 3))
    assert slot.current.describe() == {
        "policy": "least_load",
        "knobs": {"token_weight": 8},
        "version": 3,
    }
    info = [(s.labels, s.value) for f in metrics.policy_info.collect() for s in f.samples]
    assert info == [({"policy": "least_load", "knobs": "token_weight=8"}, 1.0)]
    assert metrics.registry.get_sample_value("kvrouter_policy_changes_total") == 1


# -- replicas sharing a redis-server -------------------------------------------------------


def replica(fleet: list[RunningEngine], url: str, **overrides: Any) -> RouterConfig:
    return router_config(fleet, state=fast_sync(url), admin_token=TOKEN, **overrides)


async def test_a_change_reaches_every_replica_and_the_newest_wins(
    engine_factory: EngineFactory, redis_url: str
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(replica(fleet, redis_url)) as a,
        serve_router(replica(fleet, redis_url)) as b,
        aiohttp.ClientSession() as http,
    ):
        assert len(set(await workers_served(http, b, "b-before"))) == 1
        status, changed = await admin(http, a, "PUT", "/admin/policy", {"policy": "round_robin"})
        assert status == 200 and changed["version"] == 1

        async def b_follows() -> bool:
            return bool(await policy_of(http, b) == changed)

        await wait_for(b_follows)
        assert set(await workers_served(http, b, "b-after")) == {"w0", "w1"}
        assert await metric(http, b, "kvrouter_policy_changes_total") == 1

        # A replica that starts later (its file says ttft) runs the fleet's policy from its
        # first request.
        async with serve_router(replica(fleet, redis_url, policy="ttft")) as c:
            assert await policy_of(http, c) == changed
            status, newest = await admin(
                http, b, "PUT", "/admin/policy", {"policy": "ttft", "knobs": {"cache_weight": 2.0}}
            )
            assert status == 200 and newest["version"] == 2

            async def all_follow() -> bool:
                return all([await policy_of(http, r) == newest for r in (a, b, c)])

            await wait_for(all_follow)
            assert await info_series(http, a) == {
                (
                    "ttft",
                    "cache_weight=2.0,count_offloaded=False,eviction_weight=0.0,return_weight=0.0,spread_first_turns=True,spread_reloads=True,subagents_with_parent=False,temperature=0.0,tie_tolerance=0.2,ties_spare_returns=False",
                ): 1
            }


async def test_an_emptied_redis_gets_the_fleets_policy_back(
    engine_factory: EngineFactory, redis_server: RedisServer, redis_url: str
) -> None:
    async with engines(engine_factory, 1) as fleet, aiohttp.ClientSession() as http:
        client = aioredis.Redis.from_url(redis_url)
        try:
            async with serve_router(replica(fleet, redis_url)) as a:
                status, changed = await admin(
                    http,
                    a,
                    "PUT",
                    "/admin/policy",
                    {"policy": "least_load", "knobs": {"token_weight": 4}},
                )
                assert status == 200
                redis_server.flush()  # as a Redis restarted without persistence

                async def restored() -> bool:
                    return bool(await client.hgetall(Keys("kvrouter").policy))

                await wait_for(restored)
                async with serve_router(replica(fleet, redis_url)) as later:
                    assert await policy_of(http, later) == changed
        finally:
            await client.aclose()


async def test_a_fleet_policy_unknown_here_is_ignored(
    engine_factory: EngineFactory, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica of another kvrouter version may publish a policy this one lacks."""
    caplog.set_level(logging.WARNING, logger="router.replication.sync")
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(replica(fleet, redis_url)) as a,
        aiohttp.ClientSession() as http,
    ):
        client = aioredis.Redis.from_url(redis_url)
        try:
            key = Keys("kvrouter").policy
            await client.hset(
                key, mapping={"version": 5, "policy": "from_the_future", "knobs": "{}"}
            )

            async def warned() -> bool:
                return any("not valid here" in r.getMessage() for r in caplog.records)

            await wait_for(warned)
            reads = await metric(http, a, POLICY_READS, op="policy")

            async def read_again() -> bool:  # a few more reads of the same refused hash
                return await metric(http, a, POLICY_READS, op="policy") >= reads + 3

            await wait_for(read_again)
            assert sum("not valid here" in r.getMessage() for r in caplog.records) == 1
            assert (await policy_of(http, a))["policy"] == "ttft"
            await client.hset(key, mapping={"version": 6, "policy": "round_robin"})

            async def follows() -> bool:
                return await policy_of(http, a) == {
                    "policy": "round_robin",
                    "knobs": {},
                    "version": 6,
                }

            await wait_for(follows)
        finally:
            await client.aclose()


async def test_no_change_while_redis_is_unreachable(engine_factory: EngineFactory) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(replica(fleet, "redis://127.0.0.1:1/0")) as router,
        aiohttp.ClientSession() as http,
    ):
        status, body = await admin(http, router, "PUT", "/admin/policy", {"policy": "round_robin"})
        assert status == 503 and "not changed" in body["error"]["message"]
        assert (await policy_of(http, router))["version"] == 0
