"""Load the engines report: read from /metrics, fed to policies, stale means saturated."""

from __future__ import annotations

import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.sim.config import Flavor
from bench.sim.metrics import EngineMetrics
from router.config import HealthConfig
from router.fleet.health import read_engine_metrics, wanted_samples
from tests.conftest import EngineFactory, RunningRouter, router_config, serve_router
from tests.router_client import chat_body, engines, held_stream, post, wait_for

FAST = HealthConfig(interval_s=60, scrape_interval_s=0.05, stale_after_s=1.0)


def test_vllm_and_sglang_metrics_are_read() -> None:
    for flavor, config in (
        ("vllm", {"block_size": "16", "num_gpu_blocks": "1000"}),
        ("sglang", {"max_total_num_tokens": "16000"}),
    ):
        metrics = EngineMetrics(flavor, "m", "0", config, start_time=1234.5)  # type: ignore[arg-type]
        metrics.record_step(running=3, waiting=7, kv_usage=0.25)
        facts = read_engine_metrics(metrics.render()[0].decode())
        assert (facts.running, facts.waiting, facts.kv_usage) == (3, 7, 0.25), flavor
        assert facts.started_at == 1234.5 and facts.capacity_tokens == 16_000, flavor


def engine_load(router: RunningRouter, worker: str) -> int:
    w = router.state.router.fleet.workers[worker]
    return w.engine_running + w.engine_waiting


async def test_load_sent_around_the_router_steers_it(engine_factory: EngineFactory) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet, policy="least_load", health=FAST)) as router,
        aiohttp.ClientSession() as http,
    ):
        body = chat_body([{"role": "user", "content": "hi"}], max_tokens=2)
        assert (await post(http, router.url, body)).worker == "w0"  # tie: first name
        direct = chat_body([{"role": "user", "content": "long"}], max_tokens=20_000)
        async with held_stream(http, fleet[0].url, direct):  # not through the router

            async def seen() -> bool:
                return engine_load(router, "w0") == 1

            await wait_for(seen)
            assert (await post(http, router.url, body)).worker == "w1"


async def test_a_worker_without_fresh_metrics_counts_as_saturated(
    engine_factory: EngineFactory,
) -> None:
    async with engines(engine_factory, 2) as fleet, aiohttp.ClientSession() as http:
        config = router_config(fleet, policy="least_load", health=FAST)
        async with serve_router(config) as router:
            body = chat_body([{"role": "user", "content": "hi"}], max_tokens=2)
            state = router.state.router
            w0 = state.fleet.workers["w0"]
            # Metrics that stop coming: w0 stays healthy, its load unknown.
            await http.post(fleet[0].url + "/sim/faults", json={"fail_metrics": True})

            async def stale() -> bool:
                return w0.saturated(time.monotonic(), FAST.stale_after_s)

            await wait_for(stale, timeout_s=5)
            for _ in range(3):
                assert (await post(http, router.url, body)).worker == "w1"
            await http.post(fleet[0].url + "/sim/faults", json={"fail_metrics": False})

            async def fresh() -> bool:
                return not w0.saturated(time.monotonic(), FAST.stale_after_s)

            await wait_for(fresh, timeout_s=5)
            assert (await post(http, router.url, body)).worker == "w0"


def test_the_metrics_scan_reads_what_the_full_parser_reads() -> None:
    """wanted_samples skips most of the text; on what it keeps it must agree with
    prometheus_client's parser, escaped label values included."""
    flavors: tuple[Flavor, ...] = ("vllm", "sglang")
    for flavor in flavors:
        metrics = EngineMetrics(
            flavor,
            'a "quoted"\\model\nname',
            "0",
            {"block_size": "16", "num_gpu_blocks": "100"},
            1.0e9,
        )
        metrics.record_step(3, 2, 0.5)
        text = metrics.render()[0].decode()
        names = frozenset(
            f.name if f.type != "counter" else f.name + "_total"
            for f in text_string_to_metric_families(text)
        ) | {s.name for f in text_string_to_metric_families(text) for s in f.samples}
        expected = [
            (s.name, dict(s.labels), s.value)
            for f in text_string_to_metric_families(text)
            for s in f.samples
        ]
        assert list(wanted_samples(text, names)) == expected
        assert list(wanted_samples(text, frozenset({"nothing"}))) == []
    assert list(
        wanted_samples('m{a="x"} notanumber\nm{broken 1\nm 2 1700000000\n', frozenset({"m"}))
    ) == [("m", {}, 2.0)]
