"""A stream is settled when its terminal event is in hand, before the client has it.

vLLM's uvicorn writes each event, and after the last one the end of the body, in writes of
their own; a client (the synchronous OpenAI SDK) closes as soon as it has ``[DONE]``. The
simulated engine's ``hold_stream_end`` fault holds the body's end for as long as a test
needs, so what the router does in that gap is seen every time, not by chance."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from bench.textgen import text_for
from router.config import StateConfig
from tests.conftest import TEST_MODEL, EngineFactory, RunningEngine, router_config, serve_router
from tests.replication.test_read_your_writes import met
from tests.router_client import (
    assert_idle,
    chat_body,
    conversation,
    engines,
    metric,
    parse_sse,
    set_faults,
)

# Each API: its path, and the lines that end its stream (a reply cut by its token limit
# ends as an incomplete response).
STREAMS: dict[str, tuple[str, tuple[bytes, ...]]] = {
    "chat": ("/v1/chat/completions", (b"data: [DONE]",)),
    "messages": ("/v1/messages", (b"event: message_stop",)),
    "responses": ("/v1/responses", (b"event: response.completed", b"event: response.incomplete")),
}


def streamed_body(api: str, text: str, max_tokens: int = 24) -> dict[str, Any]:
    if api == "chat":
        return {
            "model": TEST_MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    if api == "messages":
        messages = [{"role": "user", "content": text}]
        return {"model": TEST_MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True}
    return {"model": TEST_MODEL, "input": text, "max_output_tokens": max_tokens, "stream": True}


async def read_to_terminal_event(
    http: aiohttp.ClientSession, url: str, api: str, body: dict[str, Any]
) -> tuple[str | None, bytes]:
    """Reads a stream until its terminal event's line and closes the connection there,
    as the SDKs do; (the worker, what was read)."""
    path, terminals = STREAMS[api]
    read = b""
    async with http.post(url + path, json=body) as response:
        assert response.status == 200, await response.read()
        worker = response.headers.get("X-Kvrouter-Worker")
        while line := await response.content.readline():
            read += line
            if line.startswith(terminals):
                break
        response.close()  # the body's end is not read: the connection goes
    assert any(terminal in read for terminal in terminals), read
    return worker, read


async def outcomes(http: aiohttp.ClientSession, router: Any) -> dict[str, float]:
    return {
        outcome: await metric(http, router, "kvrouter_requests_total", outcome=outcome)
        for outcome in ("success", "client_disconnect")
    }


async def hold_ends(http: aiohttp.ClientSession, fleet: list[RunningEngine], on: bool) -> None:
    for engine in fleet:
        await set_faults(http, engine, hold_stream_end=on)


@pytest.mark.parametrize("api", sorted(STREAMS))
async def test_a_client_that_leaves_after_the_terminal_event_was_served(
    engine_factory: EngineFactory, api: str
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet)) as router,
        aiohttp.ClientSession() as http,
    ):
        await hold_ends(http, fleet, True)
        body = streamed_body(api, text_for(f"end-{api}", 300))
        await read_to_terminal_event(http, router.url, api, body)
        # The engine still holds its body's end, and the request is already settled.
        assert await outcomes(http, router) == {"success": 1, "client_disconnect": 0}
        await hold_ends(http, fleet, False)
        await assert_idle(http, router, wait_s=5.0)
        assert await outcomes(http, router) == {"success": 1, "client_disconnect": 0}


def _sync_sdk_streams(base_url: str, count: int) -> list[str]:
    """The synchronous SDK, as a coding agent runs it: each stream read to [DONE]."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    texts = []
    with client:
        for i in range(count):
            stream = client.chat.completions.create(
                model=TEST_MODEL,
                messages=[{"role": "user", "content": text_for(f"sdk{i}", 200)}],
                max_tokens=16,
                stream=True,
            )
            texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    return texts


async def test_the_synchronous_sdk_ends_every_stream_as_a_success(
    engine_factory: EngineFactory,
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet)) as router,
        aiohttp.ClientSession() as http,
    ):
        await hold_ends(http, fleet, True)
        # Each stream's end is held while the SDK goes on to its next request.
        texts = await asyncio.wait_for(asyncio.to_thread(_sync_sdk_streams, router.url, 3), 30)
        assert all(texts), texts
        await hold_ends(http, fleet, False)
        await assert_idle(http, router, wait_s=5.0)
        assert await outcomes(http, router) == {"success": 3, "client_disconnect": 0}


@contextlib.asynccontextmanager
async def two_replicas(
    engine_factory: EngineFactory, redis_url: str
) -> AsyncIterator[tuple[Any, Any, aiohttp.ClientSession, list[RunningEngine]]]:
    def config(fleet: list[RunningEngine], seed: int) -> Any:
        # A generous bound: a lookup given up on a busy machine would route by load alone.
        state = StateConfig(url=redis_url, flush_interval_s=5.0, path_timeout_s=5.0)
        return router_config(fleet, state=state, seed=seed)

    async with (
        engines(engine_factory, 4) as fleet,
        serve_router(config(fleet, 1)) as a,
        serve_router(config(fleet, 2)) as b,
        aiohttp.ClientSession() as http,
    ):
        await met(http, a, b)
        yield a, b, http, fleet


# Longer than a router block (64 tokens by default): the reply adds blocks of its own.
REPLY_TOKENS = 150


async def test_the_next_turn_on_another_replica_finds_the_reply_the_moment_the_client_has_it(
    engine_factory: EngineFactory, redis_url: str
) -> None:
    """The reply's blocks reach Redis before ``[DONE]`` reaches the client: replica b,
    asked for the next turn at once, predicts the whole history on a's worker."""
    async with two_replicas(engine_factory, redis_url) as (a, b, http, fleet):
        await hold_ends(http, fleet, True)
        for s in range(3):
            messages = conversation(f"ryw{s}", 400, 100)
            first, raw = await read_to_terminal_event(
                http, a.url, "chat", chat_body(messages, max_tokens=REPLY_TOKENS, stream=True)
            )
            reply, usage, _ = parse_sse(raw)
            assert usage is not None
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": text_for(f"ryw{s}-u1", 100)},
            ]
            predicted = await metric(http, b, "kvrouter_predicted_cached_tokens_total")
            second, raw = await read_to_terminal_event(
                http, b.url, "chat", chat_body(messages, max_tokens=8, stream=True)
            )
            predicted = await metric(http, b, "kvrouter_predicted_cached_tokens_total") - predicted
            _, usage2, _ = parse_sse(raw)
            assert usage2 is not None
            assert first == second, (s, first, second)
            # The prediction reaches into the reply, as far as the router's blocks do.
            cached = usage2["prompt_tokens_details"]["cached_tokens"]
            assert usage["prompt_tokens"] < predicted <= cached, (s, predicted, usage, usage2)
        await hold_ends(http, fleet, False)
