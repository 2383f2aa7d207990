"""Stored Responses conversations in the prefix index: a request continuing a stored
response (``previous_response_id``) is keyed as the conversation it continues, so the
router predicts its cached tokens as the engine reports them, turn after turn, on the
replica that relayed the response and on one that reads its chain from Redis. Real
routers over loopback HTTP, simulated engines with the model's own tokenizer (the
router keyed by the same tokens), the real OpenAI SDK, a real redis-server."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import openai
import orjson
import pytest
import redis.asyncio as aioredis

from bench.textgen import text_for
from router.config import PrefixConfig, RouterConfig, StateConfig
from router.index.prefix import render_chat_history
from router.index.stored_chain import MAX_ENCODED_BYTES
from router.replication.keys import Keys
from tests.conftest import (
    TEST_MODEL,
    EngineFactory,
    RunningEngine,
    RunningRouter,
    router_config,
    serve_router,
)
from tests.replication.test_read_your_writes import met
from tests.router_client import engines, metric, wait_for

BLOCK_BYTES = 64  # the engines' 16-token blocks, 4 bytes a token
REPLY_TOKENS = 24
EXACT = {"ignore_eos": True}  # vLLM's extra field: exactly the tokens asked for
FOLLOW_UPS = 3


def instructions() -> str:
    return text_for("chain-instructions", 300)


def question(turn: int) -> str:
    return text_for(f"chain-q{turn}", 60 + 7 * turn)


@contextlib.asynccontextmanager
async def tokenized_fleet(engine_factory: EngineFactory, model_dir: Path) -> AsyncIterator[Any]:
    """Two engines storing responses, encoding prompts with the model's tokenizer."""
    async with engines(engine_factory, 2, responses_store=True, tokenizer=str(model_dir)) as fleet:
        yield fleet


def tokens_config(
    fleet: Sequence[RunningEngine], model_dir: Path | None, **overrides: Any
) -> RouterConfig:
    tokenizer = str(model_dir) if model_dir is not None else None
    prefix = PrefixConfig(block_bytes=BLOCK_BYTES, tokenizer=tokenizer)
    return router_config(fleet, prefix=prefix, log_requests=True, **overrides)


def client_of(router: RunningRouter) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)


async def respond(
    client: openai.AsyncOpenAI, turn: int, previous: str | None, stream: bool
) -> tuple[str, int]:
    """One turn: its response's id and the engine's cached tokens."""
    response = await response_of(client, turn, previous, stream)
    assert response.usage is not None
    return response.id, response.usage.input_tokens_details.cached_tokens


async def response_of(
    client: openai.AsyncOpenAI, turn: int, previous: str | None, stream: bool
) -> Any:
    fields: dict[str, Any] = {
        "model": TEST_MODEL,
        "instructions": instructions(),
        "input": question(turn),
        "max_output_tokens": REPLY_TOKENS,
        "extra_body": EXACT,
    }
    if previous is not None:
        fields["previous_response_id"] = previous
    if stream:
        events = await client.responses.create(stream=True, **fields)
        response = None
        async for event in events:
            if event.type == "response.completed":
                response = event.response
        assert response is not None
    else:
        response = await client.responses.create(**fields)
    return response


def request_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvrouter.requests"]


def agreement(lines: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(predicted, engine-reported) cached tokens of each request."""
    return [(line["predicted_cached_tokens"], line["engine_cached_tokens"]) for line in lines]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_each_follow_up_is_predicted_as_the_engine_reports_it(
    engine_factory: EngineFactory,
    model_dir: Path,
    caplog: pytest.LogCaptureFixture,
    stream: bool,
) -> None:
    caplog.set_level(logging.INFO, logger="kvrouter.requests")
    async with (
        tokenized_fleet(engine_factory, model_dir) as fleet,
        serve_router(tokens_config(fleet, model_dir)) as router,
        client_of(router) as client,
        aiohttp.ClientSession() as http,
    ):
        previous, cached = await respond(client, 0, None, stream)
        for turn in range(1, FOLLOW_UPS + 1):
            previous, cached = await respond(client, turn, previous, stream)
            assert cached > 0
        keyed = await metric(http, router, "kvrouter_continuations_total", keyed="chain")
        assert keyed == FOLLOW_UPS
    pairs = agreement(request_lines(caplog))
    assert len(pairs) == FOLLOW_UPS + 1
    assert pairs[0] == (0, 0)
    for predicted, reported in pairs[1:]:
        assert predicted == reported > 0, pairs


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_by_text_a_follow_up_is_keyed_as_the_whole_conversation(
    engine_factory: EngineFactory, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    """Keyed by text (the default), each follow-up matches every full block of the
    conversation it continues as the chat request of the whole conversation would:
    the instructions, each question and each reply, rendered as the router renders chat."""
    caplog.set_level(logging.INFO, logger="kvrouter.requests")
    conversation: list[dict[str, Any]] = [{"role": "system", "content": instructions()}]
    block_bytes = PrefixConfig().key_block_bytes
    expected = [0]
    async with (
        engines(engine_factory, 2, responses_store=True) as fleet,
        serve_router(router_config(fleet, log_requests=True)) as router,
        client_of(router) as client,
    ):
        previous = None
        for turn in range(FOLLOW_UPS + 1):
            response = await response_of(client, turn, previous, stream)
            conversation += [
                {"role": "user", "content": question(turn)},
                {"role": "assistant", "content": response.output_text},
            ]
            canonical, _ = render_chat_history(conversation)
            expected.append(len(canonical) // block_bytes * PrefixConfig().block_tokens)
            previous = response.id
    predicted = [p for p, _ in agreement(request_lines(caplog))]
    assert predicted == expected[:-1]
    assert all(p > 0 for p in predicted[1:])


class Replicas(NamedTuple):
    a: RunningRouter
    b: RunningRouter
    via_a: openai.AsyncOpenAI
    via_b: openai.AsyncOpenAI
    http: aiohttp.ClientSession


@contextlib.asynccontextmanager
async def two_replicas(
    engine_factory: EngineFactory, model_dir: Path, redis_url: str
) -> AsyncIterator[Replicas]:
    """Two router replicas over one tokenized fleet sharing state through ``redis_url``
    (their mirrors slower than the tests' turns), each with a client, once they have met."""
    state = StateConfig(url=redis_url, path_timeout_s=1.0, flush_interval_s=5.0)
    async with (
        tokenized_fleet(engine_factory, model_dir) as fleet,
        serve_router(tokens_config(fleet, model_dir, state=state, seed=1)) as a,
        serve_router(tokens_config(fleet, model_dir, state=state, seed=2)) as b,
        client_of(a) as via_a,
        client_of(b) as via_b,
        aiohttp.ClientSession() as http,
    ):
        await met(http, a, b)
        yield Replicas(a, b, via_a, via_b, http)


async def test_a_replica_that_did_not_relay_the_response_keys_it_from_redis(
    engine_factory: EngineFactory, model_dir: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Turns alternate between two replicas, each continuing the response the other
    relayed: the chain comes with its owner from Redis (the replicas' mirrors are kept
    slower than the turns), also where the replica first learnt the owner by a GET."""
    caplog.set_level(logging.INFO, logger="kvrouter.requests")
    async with two_replicas(engine_factory, model_dir, redis_url) as r:
        previous, _ = await respond(r.via_a, 0, None, stream=False)
        for turn in range(1, FOLLOW_UPS + 1):
            client = r.via_b if turn % 2 else r.via_a
            if turn == 3:
                assert (await client.responses.retrieve(previous)).id == previous
            previous, _ = await respond(client, turn, previous, stream=turn == 2)
    pairs = agreement(request_lines(caplog))
    assert len(pairs) == FOLLOW_UPS + 1
    for predicted, reported in pairs[1:]:
        assert predicted == reported > 0, pairs


@pytest.mark.parametrize("planted", ["garbled", "oversized", "hash"])
async def test_a_chain_no_router_wrote_is_ignored_and_the_follow_up_keyed_blind(
    engine_factory: EngineFactory,
    model_dir: Path,
    redis_url: str,
    caplog: pytest.LogCaptureFixture,
    planted: str,
) -> None:
    caplog.set_level(logging.INFO, logger="kvrouter.requests")
    raw = aioredis.from_url(redis_url)
    keys = Keys("kvrouter")
    async with two_replicas(engine_factory, model_dir, redis_url) as r:
        previous, _ = await respond(r.via_a, 0, None, stream=False)
        key = keys.response_chain(previous)
        written = await raw.get(key)
        assert isinstance(written, bytes)  # a's chain, replaced:
        if planted == "garbled":
            await raw.set(key, written[: len(written) // 2] + b"\xff" * 9)
        elif planted == "oversized":
            await raw.set(key, written + b"\x00" * MAX_ENCODED_BYTES)
        else:
            await raw.delete(key)
            await raw.hset(key, "x", "y")
        _, cached = await respond(r.via_b, 1, previous, stream=False)
        assert cached > 0  # the engine holds the conversation; b cannot know it
        kind = "type" if planted == "hash" else "chain"  # a hash: deleted, off the path

        async def counted() -> bool:
            return await metric(r.http, r.b, "kvrouter_redis_bad_entries_total", kind=kind) == 1

        await wait_for(counted)
        assert await metric(r.http, r.b, "kvrouter_continuations_total", keyed="blind") == 1
    await raw.aclose()
    lines = request_lines(caplog)
    assert [line["outcome"] for line in lines] == ["success", "success"]
    assert lines[1]["predicted_cached_tokens"] == 0


@pytest.mark.parametrize("planted", ["garbled", "oversized"])
async def test_an_owner_no_router_wrote_is_counted_and_read_no_further(
    engine_factory: EngineFactory, model_dir: Path, redis_url: str, planted: str
) -> None:
    """A response's owner in Redis that no replica could have written (not an owner, or
    longer than any: only its first bytes are read) is skipped and counted; the replica
    that did not relay the response then knows no worker holding it, and says so in the
    API's own 404."""
    raw = aioredis.from_url(redis_url)
    keys = Keys("kvrouter")
    async with two_replicas(engine_factory, model_dir, redis_url) as r:
        previous, _ = await respond(r.via_a, 0, None, stream=False)
        key = keys.response(previous)
        written = await raw.get(key)
        assert isinstance(written, bytes)
        if planted == "garbled":
            await raw.set(key, b"not-a-time " + written)
        else:
            await raw.set(key, written + b"\x00" * (4 * 1024 * 1024))
        with pytest.raises(openai.NotFoundError):
            await respond(r.via_b, 1, previous, stream=False)
        assert await metric(r.http, r.b, "kvrouter_redis_bad_entries_total", kind="owner") == 1
    await raw.aclose()
