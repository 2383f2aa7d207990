"""The Responses and Anthropic Messages APIs through the router, driven by the real
``openai`` and ``anthropic`` SDKs over loopback HTTP to simulated vLLM engines: each
session's turns stay on one worker and read its cache, stored responses are found where
they were stored, errors come in each API's shape, and the engine endpoints without
prefix work are passed on."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest

from bench.textgen import text_for
from router.config import StateConfig
from tests.conftest import TEST_MODEL, EngineFactory, RunningRouter, router_config, serve_router
from tests.router_client import BLOCK, engines, metric

SESSIONS = 3
TURNS = 4
REPLY_TOKENS = 24
EXACT = {"ignore_eos": True}  # vLLM's extra field: exactly the tokens asked for
ADMIN_TOKEN = "admin-secret"


def openai_client(router: RunningRouter) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)


def anthropic_client(router: RunningRouter) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=router.url, api_key="x", max_retries=0)


def system_of(session: int) -> str:
    return text_for(f"api-s{session}-sys", 300)


def question(session: int, turn: int) -> str:
    return text_for(f"api-s{session}-u{turn}", 40)


@pytest.fixture
async def fleet(engine_factory: EngineFactory) -> AsyncIterator[list[Any]]:
    async with engines(engine_factory, 3, responses_store=True) as running:
        yield running


@pytest.fixture
async def router(fleet: list[Any]) -> AsyncIterator[RunningRouter]:
    async with serve_router(router_config(fleet, admin_token=ADMIN_TOKEN)) as running:
        yield running


def assert_each_turn_read_the_last(turns: list[tuple[str | None, int, int]]) -> None:
    """(worker, prompt tokens, cached tokens) per turn: one worker, and each turn read
    from its cache everything the turn before computed (prompt + reply - 1)."""
    assert len({worker for worker, _, _ in turns}) == 1, turns
    assert turns[0][2] == 0
    for (_, prompt, _), (_, _, cached) in itertools.pairwise(turns):
        assert cached == (prompt + REPLY_TOKENS - 1) // BLOCK * BLOCK > 0


# -- Responses --------------------------------------------------------------------------


async def responses_turn(
    client: openai.AsyncOpenAI, session: int, history: list[dict[str, Any]], stream: bool
) -> tuple[tuple[str | None, int, int], list[dict[str, Any]]]:
    """One turn of a client that sends the whole conversation (``store: false``): its
    (worker, prompt, cached) and the output items it sends back next turn."""
    fields: dict[str, Any] = {
        "model": TEST_MODEL,
        "instructions": system_of(session),
        "input": history,
        "max_output_tokens": REPLY_TOKENS,
        "store": False,
        "extra_body": EXACT,
    }
    if stream:
        events = await client.responses.create(stream=True, **fields)
        worker = events.response.headers.get("x-kvrouter-worker")
        response = None
        async for event in events:
            if event.type in ("response.completed", "response.incomplete"):
                response = event.response
        assert response is not None
    else:
        raw = await client.responses.with_raw_response.create(**fields)
        worker, response = raw.headers.get("x-kvrouter-worker"), raw.parse()
    usage = response.usage
    assert usage is not None and response.output_text
    output = [item.model_dump(exclude_none=True) for item in response.output]
    return (worker, usage.input_tokens, usage.input_tokens_details.cached_tokens), output


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_sessions_keep_their_worker_and_read_its_cache(
    router: RunningRouter, stream: bool
) -> None:
    turns: dict[int, list[tuple[str | None, int, int]]] = {s: [] for s in range(SESSIONS)}
    histories = {s: [{"role": "user", "content": question(s, 0)}] for s in range(SESSIONS)}
    async with openai_client(router) as client, aiohttp.ClientSession() as http:
        for turn in range(TURNS):
            for s in range(SESSIONS):  # interleaved, as concurrent sessions arrive
                seen, output = await responses_turn(client, s, histories[s], stream)
                turns[s].append(seen)
                histories[s] += [*output, {"role": "user", "content": question(s, turn + 1)}]
        engine_cached = await metric(
            http, router, "kvrouter_api_engine_cached_tokens_total", api="responses"
        )
        requests = await metric(
            http, router, "kvrouter_api_requests_total", api="responses", outcome="success"
        )
    for s in range(SESSIONS):
        assert_each_turn_read_the_last(turns[s])
    # The router read the cache hits from Responses' own usage fields.
    assert engine_cached == sum(cached for session in turns.values() for _, _, cached in session)
    assert requests == SESSIONS * TURNS


async def test_a_continued_response_goes_where_it_was_stored(
    router: RunningRouter, fleet: list[Any]
) -> None:
    async with openai_client(router) as client, aiohttp.ClientSession() as http:
        first = await client.responses.with_raw_response.create(
            model=TEST_MODEL,
            instructions=system_of(0),
            input=question(0, 0),
            max_output_tokens=REPLY_TOKENS,
            extra_body=EXACT,
        )
        stored, holder = first.parse(), first.headers["x-kvrouter-worker"]
        # Load the holder, so that a router choosing by load would send the next turn
        # elsewhere: only the holder has the stored conversation.
        for s in range(1, 4):
            await client.responses.create(
                model=TEST_MODEL, input=question(s, 0), max_output_tokens=4, store=False
            )
        follow = await client.responses.with_raw_response.create(
            model=TEST_MODEL,
            instructions=system_of(0),
            previous_response_id=stored.id,
            input=question(0, 1),
            max_output_tokens=REPLY_TOKENS,
            extra_body=EXACT,
            stream=False,
        )
        second = follow.parse()
        assert follow.headers["x-kvrouter-worker"] == holder
        assert second.usage is not None and stored.usage is not None
        computed = stored.usage.input_tokens + REPLY_TOKENS - 1
        assert second.usage.input_tokens_details.cached_tokens == computed // BLOCK * BLOCK

        # A streamed continuation: its id comes in response.created, and is remembered.
        events = await client.responses.create(
            model=TEST_MODEL,
            instructions=system_of(0),  # instructions do not carry over
            previous_response_id=second.id,
            input=question(0, 2),
            max_output_tokens=REPLY_TOKENS,
            extra_body=EXACT,
            stream=True,
        )
        assert events.response.headers["x-kvrouter-worker"] == holder
        third = None
        async for event in events:
            if event.type in ("response.completed", "response.incomplete"):
                third = event.response
        assert third is not None and third.usage is not None
        assert third.usage.input_tokens_details.cached_tokens > computed
        continued = await client.responses.with_raw_response.create(
            model=TEST_MODEL, previous_response_id=third.id, input="and?", max_output_tokens=4
        )
        assert continued.headers["x-kvrouter-worker"] == holder

        fetched = await client.responses.retrieve(stored.id)
        assert fetched.id == stored.id and fetched.output_text == stored.output_text
        # HEAD of it: the head of the GET, at once (its engine is asked with a GET: the
        # worker's answer to a HEAD would carry a length and no body to read).
        async with asyncio.timeout(10):
            async with http.head(f"{router.url}/v1/responses/{stored.id}") as head:
                assert head.status == 200, head.status
                assert await head.read() == b""
        assert router.state.router.fleet.workers[holder].outstanding_requests == 0
        with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous"):
            await client.responses.cancel(stored.id)  # the holder's answer: it is stored

        # Its worker gone, the response is gone with it: the engine's 404, not a guess.
        async with http.delete(
            f"{router.url}/admin/workers/{holder}",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        ) as removed:
            assert removed.status == 200, await removed.text()
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.retrieve(stored.id)
        assert missing.value.body == {
            "message": f"Response with id '{stored.id}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(
                model=TEST_MODEL, previous_response_id=stored.id, input="and?"
            )
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_never_stored")


async def test_replicas_share_where_responses_are_stored(
    engine_factory: EngineFactory, redis_url: str
) -> None:
    state = StateConfig(url=redis_url, path_timeout_s=1.0)
    async with (
        engines(engine_factory, 3, responses_store=True) as fleet,
        serve_router(router_config(fleet, state=state, seed=1)) as a,
        serve_router(router_config(fleet, state=state, seed=2)) as b,
        openai_client(a) as via_a,
        openai_client(b) as via_b,
    ):
        first = await via_a.responses.with_raw_response.create(
            model=TEST_MODEL, input=question(0, 0), max_output_tokens=8, extra_body=EXACT
        )
        stored = first.parse()
        follow = await via_b.responses.with_raw_response.create(
            model=TEST_MODEL,
            previous_response_id=stored.id,
            input=question(0, 1),
            max_output_tokens=8,
        )
        assert follow.headers["x-kvrouter-worker"] == first.headers["x-kvrouter-worker"]
        assert (await via_b.responses.retrieve(stored.id)).id == stored.id


# -- Anthropic Messages -----------------------------------------------------------------


async def messages_turn(
    client: anthropic.AsyncAnthropic, session: int, history: list[dict[str, Any]], stream: bool
) -> tuple[tuple[str | None, int, int], str]:
    fields: dict[str, Any] = {
        "model": TEST_MODEL,
        "system": system_of(session),
        "messages": history,
        "max_tokens": REPLY_TOKENS,
        "extra_body": EXACT,
    }
    if stream:
        async with client.messages.stream(**fields) as events:
            worker = events.response.headers.get("x-kvrouter-worker")
            message = await events.get_final_message()
    else:
        raw = await client.messages.with_raw_response.create(**fields)
        worker, message = raw.headers.get("x-kvrouter-worker"), await raw.parse()
    usage = message.usage
    read = usage.cache_read_input_tokens or 0
    prompt = usage.input_tokens + read + (usage.cache_creation_input_tokens or 0)
    text = "".join(block.text for block in message.content if block.type == "text")
    return (worker, prompt, read), text


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_sessions_keep_their_worker_and_read_its_cache(
    router: RunningRouter, stream: bool
) -> None:
    turns: dict[int, list[tuple[str | None, int, int]]] = {s: [] for s in range(SESSIONS)}
    histories: dict[int, list[dict[str, Any]]] = {
        s: [{"role": "user", "content": question(s, 0)}] for s in range(SESSIONS)
    }
    async with anthropic_client(router) as client, aiohttp.ClientSession() as http:
        for turn in range(TURNS):
            for s in range(SESSIONS):
                seen, text = await messages_turn(client, s, histories[s], stream)
                turns[s].append(seen)
                histories[s] += [
                    {"role": "assistant", "content": [{"type": "text", "text": text}]},
                    {"role": "user", "content": question(s, turn + 1)},
                ]
        engine_cached = await metric(
            http, router, "kvrouter_api_engine_cached_tokens_total", api="messages"
        )
        prompts = await metric(
            http, router, "kvrouter_api_usage_prompt_tokens_total", api="messages"
        )
        chat_requests = await metric(
            http, router, "kvrouter_api_requests_total", api="chat", outcome="success"
        )
    for s in range(SESSIONS):
        assert_each_turn_read_the_last(turns[s])
    # From Anthropic's usage: the hit is cache_read_input_tokens, the prompt its sum.
    assert engine_cached == sum(cached for session in turns.values() for _, _, cached in session)
    assert prompts == sum(prompt for session in turns.values() for _, prompt, _ in session)
    assert chat_requests == 0


async def test_messages_errors_come_in_anthropics_shape(router: RunningRouter) -> None:
    async with anthropic_client(router) as client, aiohttp.ClientSession() as http:
        with pytest.raises(anthropic.NotFoundError) as unknown:
            await client.messages.create(
                model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
        assert unknown.value.body == {
            "type": "error",
            "error": {
                "type": "not_found_error",
                "message": "The model `no-such-model` does not exist.",
            },
        }
        async with http.post(f"{router.url}/v1/messages", data=b"{not json") as bad:
            body = orjson.loads(await bad.read())
        assert bad.status == 400
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        async with http.post(
            f"{router.url}/v1/messages", json={"model": TEST_MODEL, "messages": "hi"}
        ) as wrong:
            body = orjson.loads(await wrong.read())
        assert wrong.status == 400 and body["type"] == "error"
        assert "messages" in body["error"]["message"]


async def test_count_tokens_embeddings_and_tokenize_are_passed_on(
    router: RunningRouter, fleet: list[Any]
) -> None:
    messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": question(0, 0)}]
    async with anthropic_client(router) as client, aiohttp.ClientSession() as http:
        counted = await client.messages.count_tokens(
            model=TEST_MODEL, system=system_of(0), messages=messages
        )
        direct = anthropic.AsyncAnthropic(base_url=fleet[0].url, api_key="x", max_retries=0)
        async with direct:
            expected = await direct.messages.count_tokens(
                model=TEST_MODEL, system=system_of(0), messages=messages
            )
        assert counted.input_tokens == expected.input_tokens > 0
        async with http.post(
            f"{router.url}/tokenize", json={"model": TEST_MODEL, "prompt": "hello world"}
        ) as tokenized:
            assert tokenized.status == 200
            ids = orjson.loads(await tokenized.read())["tokens"]
        async with http.post(
            f"{router.url}/detokenize", json={"model": TEST_MODEL, "tokens": ids}
        ) as detokenized:
            assert detokenized.status == 200
            assert "hello world" in orjson.loads(await detokenized.read())["prompt"]
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.count_tokens(model="no-such-model", messages=messages)


async def test_anthropic_clients_authenticate_with_x_api_key(fleet: list[Any]) -> None:
    """The Anthropic SDKs send their key as ``x-api-key``; a wrong one is refused in
    Anthropic's shape on every Messages route, whichever server answers it."""
    messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hi"}]
    async with serve_router(router_config(fleet, api_keys=("right-key",))) as router:
        right = anthropic.AsyncAnthropic(base_url=router.url, api_key="right-key", max_retries=0)
        wrong = anthropic.AsyncAnthropic(base_url=router.url, api_key="wrong-key", max_retries=0)
        async with right, wrong:
            reply = await right.messages.create(model=TEST_MODEL, max_tokens=4, messages=messages)
            assert reply.content
            counted = await right.messages.count_tokens(model=TEST_MODEL, messages=messages)
            assert counted.input_tokens > 0
            for call in (
                wrong.messages.create(model=TEST_MODEL, max_tokens=4, messages=messages),
                wrong.messages.count_tokens(model=TEST_MODEL, messages=messages),
            ):
                with pytest.raises(anthropic.AuthenticationError) as refused:
                    await call
                assert refused.value.body == {
                    "type": "error",
                    "error": {
                        "type": "authentication_error",
                        "message": "missing or invalid API key",
                    },
                }


async def test_a_stored_response_is_the_key_that_created_it_alone(fleet: list[Any]) -> None:
    """With several API keys, each is a tenant: another key finds no stored response of
    the first's, by id, continuation or cancel, streamed or whole; the creator does."""
    async with serve_router(router_config(fleet, api_keys=("key-a", "key-b"))) as router:
        a = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="key-a", max_retries=0)
        b = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="key-b", max_retries=0)
        async with a, b:
            stored = await a.responses.create(
                model=TEST_MODEL, input=question(0, 0), max_output_tokens=4
            )
            streamed = None
            async for event in await a.responses.create(
                model=TEST_MODEL, input=question(1, 0), max_output_tokens=4, stream=True
            ):
                if event.type == "response.completed":
                    streamed = event.response
            assert streamed is not None
            for response_id in (stored.id, streamed.id):
                assert (await a.responses.retrieve(response_id)).id == response_id
                for call in (
                    b.responses.retrieve(response_id),
                    b.responses.cancel(response_id),
                    b.responses.create(
                        model=TEST_MODEL, previous_response_id=response_id, input="and?"
                    ),
                ):
                    with pytest.raises(openai.NotFoundError):
                        await call
            continued = await a.responses.create(
                model=TEST_MODEL, previous_response_id=stored.id, input="and?", max_output_tokens=4
            )
            assert continued.id != stored.id
