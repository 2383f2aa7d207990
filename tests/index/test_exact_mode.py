"""Exact mode end to end: a router subscribed to its simulated engines' KV events over
loopback, saying per worker which mode it routes in."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from bench.ports import free_port
from bench.textgen import text_for
from router.config import KvEventsConfig as RouterKvEvents
from router.config import (
    KvEventsEndpoints,
    PrefixConfig,
    RouterConfig,
    StateConfig,
    WorkerConfig,
)
from tests.conftest import EngineFactory, RunningEngine, router_config, serve_router
from tests.kv_publisher import publishing_engine
from tests.router_client import chat_body, conversation, metric, post

TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENGINE_BLOCK = 16


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


def predictions(records: list[logging.LogRecord]) -> list[tuple[int, int]]:
    """(predicted, engine-reported) cached tokens of every later turn in the request log."""
    seen: set[str] = set()
    pairs = []
    for record in records:
        line = orjson.loads(record.getMessage())
        if line["session"] in seen and line["outcome"] == "success":
            pairs.append((line["predicted_cached_tokens"], line["engine_cached_tokens"]))
        seen.add(line["session"])
    return pairs


async def agent_turns(
    http: aiohttp.ClientSession, url: str, sessions: int, turns: int
) -> list[str]:
    """Sessions taking turns one request at a time, each turn appending a reply and a
    tool result; a pause between requests, as an agent's tool time (the engine's last
    events arrive meanwhile)."""
    chats = {f"s{i}": conversation(f"exact-s{i}", 400, 150) for i in range(sessions)}
    workers = []
    for turn in range(turns):
        for key, messages in chats.items():
            body = chat_body(messages, max_tokens=40, user=key)
            result = await post(http, url, body)
            assert result.status == 200, result.raw
            workers.append(str(result.worker))
            messages += [
                {"role": "assistant", "content": result.text},
                {"role": "user", "content": text_for(f"{key}-t{turn}", 200)},
            ]
            await asyncio.sleep(0.2)
    return workers


@pytest.mark.parametrize(
    ("exact", "tokenizer"),
    [(True, "files"), (False, "files"), (True, "engine")],
    ids=["exact", "approximate", "exact-engine-tokens"],
)
async def test_under_eviction_exact_mode_knows_what_each_engine_holds(
    engine_factory: EngineFactory,
    model_dir: Path,
    caplog: pytest.LogCaptureFixture,
    exact: bool,
    tokenizer: str,
) -> None:
    # Two engines of 3,000 tokens for four sessions growing past 1,500 tokens each: every
    # engine evicts, and each session's turns must find what is left.
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(aiohttp.ClientSession())
        fleet = [
            await stack.enter_async_context(
                publishing_engine(engine_factory, tokenizer=str(model_dir), kv_tokens=3000)
            )
            for _ in range(2)
        ]
        # The modelled LRU is told twice the engines' capacity, as when an engine's
        # memory is not what its configuration says; exact mode reads what it holds.
        workers = tuple(
            WorkerConfig(
                engine.url,
                name=f"w{i}",
                kv_events=endpoints if exact else None,
                kv_tokens=None if exact else 6000,
            )
            for i, (engine, endpoints) in enumerate(fleet)
        )
        config = router_config(
            [engine for engine, _ in fleet],
            workers=workers,
            prefix=PrefixConfig(
                block_bytes=4 * ENGINE_BLOCK,
                tokenizer=str(model_dir) if tokenizer == "files" else "engine",
            ),
            log_requests=True,
            # Gone before the next turn: what the router knows then, the events told it.
            kv_events=RouterKvEvents(speculative_ttl_s=0.1),
        )
        router = await stack.enter_async_context(serve_router(config))
        if exact:
            for name in ("w0", "w1"):
                await eventually(functools.partial(_is_exact, http, router.url, name))
        with caplog.at_level(logging.INFO, logger="kvrouter.requests"):
            await agent_turns(http, router.url, sessions=4, turns=5)
        removed = await metric(http, router, "kvrouter_kv_events_total", type="removed")
        pairs = predictions([r for r in caplog.records if r.name == "kvrouter.requests"])
    assert len(pairs) == 16
    misjudged = [(p, e) for p, e in pairs if abs(p - e) > ENGINE_BLOCK]
    if exact:
        assert removed > 0  # the engines did evict
        assert misjudged == []
    else:
        # The modelled LRU of a capacity other than the engine's misjudges some turns
        # under the same eviction: what exact mode is for. (Sized right, it agrees on
        # this small run: replies are in both chains.)
        assert misjudged != []


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "tokens"])
async def test_engines_of_different_block_sizes_are_predicted_in_their_own_blocks(
    engine_factory: EngineFactory,
    model_dir: Path,
    caplog: pytest.LogCaptureFixture,
    exact: bool,
) -> None:
    # One engine of 16-token blocks (vLLM's GPU default), one of 32 (its CPU build's);
    # the router is told neither and keeps its default block size. Both evict.
    block_sizes = {"w0": 16, "w1": 32}
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(aiohttp.ClientSession())
        fleet = [
            await stack.enter_async_context(
                publishing_engine(
                    engine_factory, tokenizer=str(model_dir), kv_tokens=3072, block_tokens=size
                )
            )
            for size in block_sizes.values()
        ]
        workers = tuple(
            WorkerConfig(engine.url, name=name, kv_events=endpoints if exact else None)
            for name, (engine, endpoints) in zip(block_sizes, fleet, strict=True)
        )
        config = router_config(
            [engine for engine, _ in fleet],
            workers=workers,
            prefix=PrefixConfig(tokenizer=str(model_dir)),
            log_requests=True,
            kv_events=RouterKvEvents(speculative_ttl_s=0.1),
            admin_token=TOKEN,
        )
        router = await stack.enter_async_context(serve_router(config))
        for name in block_sizes:
            if exact:
                await eventually(functools.partial(_is_exact, http, router.url, name))
            await eventually(functools.partial(_knows_block_size, http, router.url, name))
        with caplog.at_level(logging.INFO, logger="kvrouter.requests"):
            await agent_turns(http, router.url, sessions=4, turns=4)
        lines = [
            orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvrouter.requests"
        ]
    seen: set[str] = set()
    later = []
    for line in lines:
        if line["session"] in seen:
            later.append(line)
        seen.add(line["session"])
    assert len(later) == 12 and {line["worker"] for line in later} == set(block_sizes)
    for line in later:
        block = block_sizes[line["worker"]]
        predicted, reported = line["predicted_cached_tokens"], line["engine_cached_tokens"]
        assert predicted % block == 0, line  # the engine's whole blocks, never part of one
        assert abs(predicted - reported) <= block, line


async def _knows_block_size(http: aiohttp.ClientSession, url: str, worker: str) -> bool:
    workers = await admin_workers(http, url)
    return workers[worker]["engine_block_tokens"] is not None


async def _is_exact(http: aiohttp.ClientSession, url: str, worker: str) -> bool:
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    return f'kvrouter_prefix_mode{{mode="exact",worker="{worker}"}} 1.0' in text


def exact_config(
    engine: RunningEngine, endpoints: KvEventsEndpoints, model_dir: Path, **overrides: Any
) -> RouterConfig:
    """A router of one exact worker, w0, keyed by the test model's tokens."""
    return router_config(
        [engine],
        workers=(WorkerConfig(engine.url, name="w0", kv_events=endpoints),),
        prefix=PrefixConfig(block_bytes=4 * ENGINE_BLOCK, tokenizer=str(model_dir)),
        **{
            # Gone before the next turn: what the router knows then, the events told it.
            "kv_events": RouterKvEvents(speculative_ttl_s=0.1),
            **overrides,
        },
    )


async def test_a_restarted_engine_is_rebuilt_from_its_new_events(
    engine_factory: EngineFactory, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        publishing_engine(engine_factory, tokenizer=str(model_dir)) as (engine, endpoints),
        aiohttp.ClientSession() as http,
    ):
        config = exact_config(engine, endpoints, model_dir, log_requests=True)
        async with serve_router(config) as router:
            await eventually(functools.partial(_is_exact, http, router.url, "w0"))
            with caplog.at_level(logging.INFO, logger="kvrouter.requests"):
                await agent_turns(http, router.url, sessions=1, turns=2)
                async with http.post(engine.url + "/sim/restart") as response:
                    assert response.status == 200

                async def forgotten() -> bool:
                    resident = await metric(
                        http, router, "kvrouter_worker_resident_tokens", worker="w0"
                    )
                    return resident == 0

                await eventually(forgotten)  # the prober saw the new process start
                await agent_turns(http, router.url, sessions=1, turns=2)
            assert await _is_exact(http, router.url, "w0")
    pairs = predictions([r for r in caplog.records if r.name == "kvrouter.requests"])
    # The session's second turn; its opening prompt sent again after the restart, which
    # found nothing, as the router knew; and the turn after it, which found its history
    # as the new process announced it (with the old sequence's numbers, it would not be).
    assert len(pairs) == 3
    assert all(abs(p - e) <= ENGINE_BLOCK for p, e in pairs), pairs
    assert pairs[1][1] == 0 and pairs[2][1] > 0


async def test_replicas_sharing_state_each_read_the_events_and_agree(
    engine_factory: EngineFactory, model_dir: Path, redis_url: str
) -> None:
    async with (
        publishing_engine(engine_factory, tokenizer=str(model_dir)) as (engine, endpoints),
        aiohttp.ClientSession() as http,
    ):
        config = exact_config(engine, endpoints, model_dir, state=StateConfig(url=redis_url))
        async with serve_router(config) as one, serve_router(config) as other:
            for router in (one, other):
                await eventually(functools.partial(_is_exact, http, router.url, "w0"))
            messages = conversation("replicas", 400, 150)
            first = await post(http, one.url, chat_body(messages, max_tokens=16))
            assert first.status == 200, first.raw
            await asyncio.sleep(0.3)  # past the speculative entries' lapse
            indexes = [r.state.router.index for r in (one, other)]
            held = [index.resident_blocks("w0") for index in indexes]
            # What the engine holds, decode blocks included (which no request's touch
            # names): the other replica, which never saw the request, holds exactly that
            # because it read the same events.
            engine_blocks = len(engine.engine.scheduler.pool._cached)
            assert held == [engine_blocks, engine_blocks]
            messages += [
                {"role": "assistant", "content": first.text},
                {"role": "user", "content": text_for("replicas-u1", 100)},
            ]
            second = await post(http, other.url, chat_body(messages, max_tokens=16))
            assert second.status == 200, second.raw
            assert second.cached > 0


async def test_blocks_the_queue_ahead_will_evict_are_not_predicted_cached(
    engine_factory: EngineFactory, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # One engine of 3,000 tokens holds a session's first turn. Its second turn is routed
    # behind a long fresh prompt queued on the same engine: that prompt will take the
    # free room and then the session's oldest blocks, its tail, before the turn is
    # scheduled. The prediction must say what the engine will report, not what it holds.
    async with (
        publishing_engine(engine_factory, tokenizer=str(model_dir), kv_tokens=3000) as (
            engine,
            endpoints,
        ),
        aiohttp.ClientSession() as http,
    ):
        config = exact_config(
            engine,
            endpoints,
            model_dir,
            log_requests=True,
            kv_events=RouterKvEvents(speculative_ttl_s=0.1, forecast_queue_evictions=True),
        )
        async with serve_router(config) as router:
            await eventually(functools.partial(_is_exact, http, router.url, "w0"))
            session = conversation("queued-behind", 700, 300)
            with caplog.at_level(logging.INFO, logger="kvrouter.requests"):
                first = await post(http, router.url, chat_body(session, max_tokens=8, user="a"))
                assert first.status == 200, first.raw
                await asyncio.sleep(0.3)  # its blocks announced, its guesses lapsed
                session += [
                    {"role": "assistant", "content": first.text},
                    {"role": "user", "content": text_for("queued-behind-t1", 100)},
                ]
                await set_stall(http, engine.url, True)  # both queue, in arrival order
                ahead = asyncio.create_task(
                    post(http, router.url, chat_body(conversation("ahead", 1600, 200), user="b"))
                )
                await asyncio.sleep(0.2)
                turn = asyncio.create_task(
                    post(http, router.url, chat_body(session, max_tokens=8, user="a"))
                )
                await asyncio.sleep(0.2)
                await set_stall(http, engine.url, False)
                for result in await asyncio.gather(ahead, turn):
                    assert result.status == 200, result.raw
    ((predicted, reported),) = predictions(
        [r for r in caplog.records if r.name == "kvrouter.requests"]
    )
    assert first.usage is not None
    assert 0 < reported < first.usage["prompt_tokens"] - 4 * ENGINE_BLOCK  # the tail went
    assert abs(predicted - reported) <= ENGINE_BLOCK, (predicted, reported)


async def set_stall(http: aiohttp.ClientSession, url: str, stall: bool) -> None:
    async with http.post(url + "/sim/faults", json={"stall": stall}) as response:
        assert response.status == 200
