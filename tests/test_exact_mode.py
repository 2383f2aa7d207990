"""Exact mode end to end: a router subscribed to its simulated engines' KV events over
loopback, saying per worker which mode it routes in."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.sim.kv_events import KVEventsConfig
from router.config import KvEventsEndpoints, PrefixConfig, WorkerConfig
from tests.conftest import EngineFactory, RunningEngine, router_config, serve_router
from tests.kv_publisher import free_port
from tests.router_client import chat_body, conversation, metric, post
from tests.token_model import build_model_dir

TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENGINE_BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("qwen3"))


@contextlib.asynccontextmanager
async def publishing_engine(
    engine_factory: EngineFactory, **overrides: Any
) -> AsyncIterator[tuple[RunningEngine, KvEventsEndpoints]]:
    """A simulated engine started with vLLM's --kv-events-config on free ports."""
    port, replay = free_port(), free_port()
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay}",
    )
    async with engine_factory(kv_events=events, **overrides) as engine:
        yield engine, KvEventsEndpoints(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def admin_workers(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/admin/workers", headers=AUTH) as response:
        assert response.status == 200
        body = await response.json()
    return {w["name"]: w for w in body["workers"]}


async def test_a_worker_announcing_its_kv_events_is_exact_and_the_router_says_so(
    engine_factory: EngineFactory, model_dir: Path
) -> None:
    async with (
        publishing_engine(engine_factory) as (announcing, endpoints),
        engine_factory() as silent,
        aiohttp.ClientSession() as http,
    ):
        nobody = f"tcp://127.0.0.1:{free_port()}"
        config = router_config(
            [announcing, silent],
            workers=(
                WorkerConfig(announcing.url, name="w0", kv_events=endpoints),
                WorkerConfig(silent.url, name="w1", kv_events=KvEventsEndpoints(nobody)),
            ),
            prefix=PrefixConfig(block_bytes=4 * ENGINE_BLOCK, tokenizer=str(model_dir)),
            admin_token=TOKEN,
            policy="round_robin",
        )
        async with serve_router(config) as router:

            async def mode(worker: str, which: str) -> float:
                return await metric(http, router, "kvrouter_prefix_mode", worker=worker, mode=which)

            async def w0_exact() -> bool:
                return await mode("w0", "exact") == 1

            await eventually(w0_exact)  # its replay endpoint answered
            assert await mode("w1", "approximate") == 1
            workers = await admin_workers(http, router.url)
            assert workers["w0"]["prefix_mode"] == "exact"
            assert workers["w0"]["kv_events"]["endpoint"] == endpoints.endpoint
            assert workers["w1"]["prefix_mode"] == "approximate"
            assert workers["w1"]["kv_events"]["ranks"][0]["next_seq"] is None

            before = await metric(http, router, "kvrouter_kv_event_batches_total", worker="w0")
            served = set()
            for i in range(2):  # round robin: one each
                messages = conversation(f"exact{i}", 300, 120)
                result = await post(http, router.url, chat_body(messages, max_tokens=4))
                assert result.status == 200, result.raw
                served.add(result.worker)
            assert served == {"w0", "w1"}

            async def announced() -> bool:
                batches = await metric(http, router, "kvrouter_kv_event_batches_total", worker="w0")
                return batches > before

            await eventually(announced)

            async with http.delete(router.url + "/admin/workers/w0", headers=AUTH) as response:
                assert response.status == 200

            async def unsubscribed() -> bool:
                return await mode("w0", "exact") == 0 and not await metric(
                    http, router, "kvrouter_kv_event_batches_total", worker="w0"
                )

            await eventually(unsubscribed)


async def test_a_worker_with_kv_events_needs_the_engines_tokens(
    engine_factory: EngineFactory,
) -> None:
    async with engine_factory() as engine, aiohttp.ClientSession() as http:
        config = router_config([engine], admin_token=TOKEN)
        async with serve_router(config) as router:
            worker = {
                "url": "http://127.0.0.1:9",
                "name": "x",
                "kv_events": {"endpoint": "tcp://h:1"},
            }
            async with http.post(router.url + "/admin/workers", json=worker, headers=AUTH) as r:
                assert r.status == 400
                assert "prefix.tokenizer" in (await r.json())["error"]["message"]
