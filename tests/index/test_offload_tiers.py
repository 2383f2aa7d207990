"""The CPU tiers behind the engines' caches, end to end: simulated engines offloading as
vLLM's native connector does, a router subscribed to their KV events. A session pushed
off its engine's GPU (by traffic the router never saw) is still in that engine's CPU
tier: its next turn goes there, is read back rather than computed, and is counted as
reloaded; a tier announced by hash alone is named as well, and one the engine reads
from without announcing it is shown as such."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.textgen import text_for
from router.config import CapacityConfig, OffloadConfig, PrefixConfig, WorkerConfig
from router.config import KvEventsConfig as RouterKvEvents
from tests.conftest import EngineFactory, router_config, serve_router
from tests.index.test_exact_mode import _is_exact, eventually
from tests.kv_publisher import publishing_engine
from tests.router_client import chat_body, conversation, metric, post

ENGINE_BLOCK = 16
BYTES_PER_TOKEN = 131_072  # llama-3.1-8b's (the engines' model), bf16
SELF_DESCRIBING = '{"kv_connector_extra_config": {"self_describing_kv_events": true}}'


def offloading(self_describing: bool) -> dict[str, Any]:
    """A 3,000-token GPU cache and a CPU tier ten times its size."""
    return {
        "kv_tokens": 3000,
        "kv_offloading_bytes": 30_000 * BYTES_PER_TOKEN,
        "kv_offloading_self_describing_events": self_describing,
    }


@pytest.mark.parametrize(
    ("announced", "self_describing", "modelled", "state"),
    [
        (True, True, 0, "announced"),
        (True, False, 0, "by_hash"),
        (False, True, 0, "unannounced"),
        (False, True, 30_000, "modelled"),
    ],
)
async def test_a_session_pushed_off_the_gpu_is_read_back_from_its_engines_cpu_tier(
    engine_factory: EngineFactory,
    model_dir: Path,
    announced: bool,
    self_describing: bool,
    modelled: int,
    state: str,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(aiohttp.ClientSession())
        fleet = [
            await stack.enter_async_context(
                publishing_engine(
                    engine_factory, tokenizer=str(model_dir), **offloading(self_describing)
                )
            )
            for _ in range(2)
        ]
        workers = tuple(
            WorkerConfig(engine.url, name=f"w{i}", kv_events=endpoints if announced else None)
            for i, (engine, endpoints) in enumerate(fleet)
        )
        config = router_config(
            [engine for engine, _ in fleet],
            workers=workers,
            prefix=PrefixConfig(block_bytes=4 * ENGINE_BLOCK, tokenizer=str(model_dir)),
            capacity=CapacityConfig(kv_tokens=3000, model="llama-3.1-8b", gpu="h100"),
            kv_events=RouterKvEvents(speculative_ttl_s=0.1),
            offload=OffloadConfig(tier_tokens=modelled),
            policy="ttft",
            # The read-back path itself: the tie rule on full caches is a unit test's.
            policy_knobs={"count_offloaded": True, "spread_reloads": False},
        )
        router = await stack.enter_async_context(serve_router(config))
        if announced:
            for name in ("w0", "w1"):
                await eventually(functools.partial(_is_exact, http, router.url, name))

        messages = conversation("tiered", 600, 200)
        first = await post(http, router.url, chat_body(messages, max_tokens=40, user="s"))
        assert first.status == 200, first.raw
        holder = int(str(first.worker)[1])
        messages += [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": text_for("tiered-u1", 100)},
        ]
        # Traffic the router never sees fills the holder's GPU: the session's blocks go
        # (announced as removed from the GPU), its CPU copies stay.
        engine = fleet[holder][0]
        for i in range(3):
            other = await post(http, engine.url, chat_body(conversation(f"other{i}", 1000, 100)))
            assert other.status == 200, other.raw
        tiered = f"w{holder}"
        if announced:

            async def on_cpu_only() -> bool:
                offloaded = await metric(
                    http, router, "kvrouter_worker_offloaded_tokens", worker=tiered
                )
                return offloaded > 2000

            await eventually(on_cpu_only)

        second = await post(http, router.url, chat_body(messages, max_tokens=8, user="s"))
        assert second.status == 200, second.raw
        assert second.worker == tiered
        assert first.usage is not None and second.usage is not None
        cached = int(second.usage["prompt_tokens_details"]["cached_tokens"])
        assert cached >= first.usage["prompt_tokens"] - ENGINE_BLOCK
        async with http.get(engine.url + "/sim/requests") as response:
            last = (await response.json())["requests"][-1]
        # The engine read the whole history back from its CPU tier: nothing of it was
        # left on the GPU.
        assert last["cached_at_schedule"] == last["loaded"] == cached
        assert last["first_token"] > last["scheduled"] >= last["arrived"]

        reloaded = await metric(http, router, "kvrouter_turns_total", outcome="reloaded")
        offloaded_predicted = await metric(
            http, router, "kvrouter_predicted_offloaded_tokens_total", worker=tiered
        )

        async def tier_is(expected: str) -> bool:
            states = await metric(
                http, router, "kvrouter_offload_tier", worker=tiered, state=expected
            )
            return states == 1

        if announced:
            assert reloaded == 1
            assert offloaded_predicted > 0
        else:
            # The router modelled the session on the GPU: right worker, wrong tier; it
            # cannot tell the turn was read back, but the engine's /metrics say a tier
            # is there.
            assert reloaded == 0 and offloaded_predicted == 0
        await eventually(functools.partial(tier_is, state))
        # What the engine read back, as its /metrics say (read on the next scrape).
        hits = "kvrouter_worker_engine_offload_hit_tokens_total"

        async def engine_read_back() -> bool:
            return await metric(http, router, hits, worker=tiered) >= cached - ENGINE_BLOCK * 4

        await eventually(engine_read_back)
        rate = await metric(http, router, "kvrouter_offload_reload_tokens_per_second")
        assert rate == pytest.approx(50e9 / BYTES_PER_TOKEN)
