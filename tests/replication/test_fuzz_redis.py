"""A hostile Redis, generated: the short version of ``kvrouter bench fuzz --side redis``.

A router sharing its state through a real redis-server, over two simulated engines,
serves multi-turn sessions while generated writes (``bench/fuzz/redis_inputs.py``) land
in its keys: fake replicas and their loads and rates, index changes on the stream,
residency sets, the fleet policy, and the router's own keys overwritten with other
types. Every normal turn must be served; no sync loop may fail; what was skipped is
counted by kind.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from bench.fuzz.redis_inputs import RedisCase, redis_cases
from bench.fuzz.redis_side import RedisWriter, session_turn
from bench.fuzz.watch import metric_total, metrics_page, watching
from router.config import StateConfig
from tests.conftest import TEST_MODEL, EngineFactory, router_config, serve_router
from tests.edge.test_fuzz import check_all

API_KEY = "fuzz-key"
NAMESPACE = "kvrouter"
CASES = 150


async def test_nothing_written_to_redis_costs_a_normal_turn_or_a_sync_loop(
    engine_factory: EngineFactory, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        engine_factory(time_scale=1000.0) as e0,
        engine_factory(time_scale=1000.0) as e1,
        serve_router(
            router_config(
                [e0, e1],
                api_keys=(API_KEY,),
                state=StateConfig(
                    url=redis_url,
                    namespace=NAMESPACE,
                    load_interval_s=0.05,
                    stream_retention_s=5.0,
                    path_timeout_s=0.05,
                ),
            )
        ) as router,
    ):
        port = int(router.url.rsplit(":", 1)[1])
        writer = RedisWriter(redis_url, NAMESPACE)
        caplog.set_level(logging.WARNING)

        def check(case: RedisCase) -> None:
            writer.apply(case)

        try:
            async with watching(port, session_turn(API_KEY, TEST_MODEL)) as (normal, probe):
                await asyncio.to_thread(
                    check_all, CASES, redis_cases(NAMESPACE, ("w0", "w1")), check
                )
                await asyncio.sleep(0.5)  # the last cases read
            await asyncio.to_thread(writer.finish)
        finally:
            writer.close()
        page = await asyncio.to_thread(metrics_page, port)

    assert normal.tally.sent > 0 and normal.tally.failed == 0, normal.tally
    assert probe.failures == 0
    assert metric_total(page, "kvrouter_redis_loop_failures_total") == 0
    unexpected = [r for r in caplog.records if r.exc_info and r.name.startswith("router")]
    assert not unexpected, unexpected[0].getMessage()
    # What the loops read all the time (residency sets are read at a resync only).
    for kind in ("load", "rate", "stream", "replica", "type"):
        assert metric_total(page, "kvrouter_redis_bad_entries_total", kind=kind) > 0, kind
    print(writer.tally, normal.tally.statuses, f"worst /health {probe.worst_s:.3f} s")
