"""The router in front of real vLLM engines (the CPU build; ``tests/vllm_engines.py``),
through the real OpenAI and Anthropic SDKs, synchronous and asynchronous.

Each test runs its own router over the session's two engines, whose caches are emptied
first. What is asserted is what the engines themselves report: every request a success,
a session kept on its worker, and the router's prediction of each later turn's cached
tokens against the ``cached_tokens`` the engine returned."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam
from openai.types.responses import ResponseInputParam, ResponseTextDeltaEvent

from bench.textgen import text_for
from bench.workloads.api_bodies import AGENT_TOOLS
from router.config import (
    HealthConfig,
    KvEventsEndpoints,
    PrefixConfig,
    RouterConfig,
    StateConfig,
    WorkerConfig,
)
from router.config import KvEventsConfig as RouterKvEvents
from tests.conftest import serve_router
from tests.replication.test_read_your_writes import met
from tests.router_client import metric, post
from tests.tcp_proxy import tcp_proxy
from tests.vllm_engines import BLOCK_TOKENS, MODEL_NAME, NUM_BLOCKS, VllmEngine

pytestmark = pytest.mark.timeout(300)

TURNS = 3
# Short: a random model's reply (bytes of unrelated tokens) mostly does not encode back
# to the ids it was generated as, so token mode's guess at the reply's blocks (its text's
# tokens) is off by up to the reply's length; exact mode is not. A real model's text does.
REPLY_TOKENS = 24
TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
Turns = Callable[[str, str], list[str]]


@pytest.fixture
async def fleet(vllm_fleet: list[VllmEngine]) -> AsyncIterator[list[VllmEngine]]:
    """The session's engines as they started, their prefix caches emptied."""
    for engine in vllm_fleet:
        if not engine.prompt_tokens_details:  # a test restarted it without
            engine.prompt_tokens_details = True
            await engine.restart()
    async with aiohttp.ClientSession() as http:
        for engine in vllm_fleet:
            url = engine.url + "/reset_prefix_cache?reset_running_requests=true"
            async with http.post(url) as response:
                assert response.status == 200, await response.text()
    yield vllm_fleet


def real_config(fleet: list[VllmEngine], mode: str, **overrides: Any) -> RouterConfig:
    """A router over the engines keyed by their tokens (``tokens``: the model's own
    tokenizer; ``engine``: their ``/tokenize``; ``exact``: tokens and KV events), its
    block size left to the router (16 tokens, two to each of the engines' blocks)."""
    model_dir = fleet[0].model_dir
    tokenizer = "engine" if mode == "engine" else str(model_dir)
    workers = tuple(
        WorkerConfig(
            e.url,
            name=e.name,
            kv_events=KvEventsEndpoints(e.kv_events_endpoint, e.replay_endpoint)
            if mode == "exact"
            else None,
        )
        for e in fleet
    )
    values: dict[str, Any] = {
        "workers": workers,
        "host": "127.0.0.1",
        "port": 0,
        "health": HealthConfig(interval_s=60.0),
        "seed": 1,
        "worker_header": True,
        "admin_token": TOKEN,
        "log_requests": True,
        "prefix": PrefixConfig(tokenizer=tokenizer),
    }
    values.update(overrides)
    return RouterConfig(**values)


def user_text(session: str, turn: int) -> str:
    return text_for(f"{session}-u{turn}", 60 if turn else 200)


# -- one session, through each client -----------------------------------------------------


def client_options(session: str) -> dict[str, Any]:
    """What every SDK client here is built with: no retries, the session's header."""
    return {"api_key": "unused", "max_retries": 0, "default_headers": {"X-Session-Id": session}}


def next_turn(session: str, turn: int, reply: str) -> list[Any]:
    """The reply and the next user message, as each API's history carries them."""
    return [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": user_text(session, turn + 1)},
    ]


def chat_sync_stream(url: str, session: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", **client_options(session))
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": user_text(session, 0)}
    ]
    replies = []
    with client:
        for turn in range(TURNS):
            stream = client.chat.completions.create(
                model=MODEL_NAME,
                messages=messages,
                max_tokens=REPLY_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            replies.append(text)
            messages += next_turn(session, turn, text)
    return replies


async def chat_async_whole(url: str, session: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", **client_options(session))
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": user_text(session, 0)}
    ]
    replies = []
    async with client:
        for turn in range(TURNS):
            reply = await client.chat.completions.create(
                model=MODEL_NAME,
                messages=messages,
                max_tokens=REPLY_TOKENS,
            )
            text = reply.choices[0].message.content or ""
            replies.append(text)
            messages += next_turn(session, turn, text)
    return replies


async def completions_async_stream(url: str, session: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", **client_options(session))
    prompt = user_text(session, 0)
    replies = []
    async with client:
        for turn in range(TURNS):
            stream = await client.completions.create(
                model=MODEL_NAME,
                prompt=prompt,
                max_tokens=REPLY_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
            )
            text = "".join([c.choices[0].text async for c in stream if c.choices])
            replies.append(text)
            prompt += text + user_text(session, turn + 1)
    return replies


def responses_sync_stream(url: str, session: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", **client_options(session))
    items: ResponseInputParam = [{"role": "user", "content": user_text(session, 0)}]
    replies = []
    with client:
        for turn in range(TURNS):
            stream = client.responses.create(
                model=MODEL_NAME,
                input=items,
                max_output_tokens=REPLY_TOKENS,
                stream=True,
            )
            text = "".join(e.delta for e in stream if isinstance(e, ResponseTextDeltaEvent))
            replies.append(text)
            items += next_turn(session, turn, text)
    return replies


async def responses_async_whole(url: str, session: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", **client_options(session))
    items: ResponseInputParam = [{"role": "user", "content": user_text(session, 0)}]
    replies = []
    async with client:
        for turn in range(TURNS):
            reply = await client.responses.create(
                model=MODEL_NAME,
                input=items,
                max_output_tokens=REPLY_TOKENS,
            )
            replies.append(reply.output_text)
            items += next_turn(session, turn, reply.output_text)
    return replies


def messages_sync_stream(url: str, session: str) -> list[str]:
    client = anthropic.Anthropic(base_url=url, **client_options(session))
    messages: list[MessageParam] = [{"role": "user", "content": user_text(session, 0)}]
    replies = []
    with client:
        for turn in range(TURNS):
            with client.messages.stream(
                model=MODEL_NAME,
                messages=messages,
                max_tokens=REPLY_TOKENS,
            ) as stream:
                text = "".join(stream.text_stream)
            replies.append(text)
            messages += next_turn(session, turn, text)
    return replies


async def messages_async_whole(url: str, session: str) -> list[str]:
    client = anthropic.AsyncAnthropic(base_url=url, **client_options(session))
    messages: list[MessageParam] = [{"role": "user", "content": user_text(session, 0)}]
    replies = []
    async with client:
        for turn in range(TURNS):
            reply = await client.messages.create(
                model=MODEL_NAME,
                messages=messages,
                max_tokens=REPLY_TOKENS,
            )
            text = "".join(b.text for b in reply.content if b.type == "text")
            replies.append(text)
            messages += next_turn(session, turn, text)
    return replies


SYNC_CLIENTS: dict[str, Callable[[str, str], list[str]]] = {
    "chat-sync-stream": chat_sync_stream,
    "responses-sync-stream": responses_sync_stream,
    "messages-sync-stream": messages_sync_stream,
}
ASYNC_CLIENTS = {
    "chat-async-whole": chat_async_whole,
    "completions-async-stream": completions_async_stream,
    "responses-async-whole": responses_async_whole,
    "messages-async-whole": messages_async_whole,
}


async def run_session(client: str, url: str, session: str) -> list[str]:
    if client in SYNC_CLIENTS:
        return await asyncio.to_thread(SYNC_CLIENTS[client], url, session)
    return await ASYNC_CLIENTS[client](url, session)


def request_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvrouter.requests"]


def later_turns(lines: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(predicted, engine-reported) cached tokens of every later turn of a session."""
    seen: set[str] = set()
    pairs = []
    for line in lines:
        if line["session"] in seen:
            pairs.append((line["predicted_cached_tokens"], line["engine_cached_tokens"]))
        seen.add(line["session"])
    return pairs


# -- the tests -----------------------------------------------------------------------------


async def test_the_router_reads_each_engines_capacity_and_block_size(
    fleet: list[VllmEngine],
) -> None:
    async with (
        serve_router(real_config(fleet, "tokens")) as router,
        aiohttp.ClientSession() as http,
    ):
        async with http.get(router.url + "/ready") as response:
            assert response.status == 200
            assert (await response.json())["healthy_workers"] == [e.name for e in fleet]
        async with http.get(router.url + "/admin/workers", headers=AUTH) as response:
            workers = {w["name"]: w for w in (await response.json())["workers"]}
    for engine in fleet:
        assert workers[engine.name]["capacity_tokens"] == NUM_BLOCKS * BLOCK_TOKENS


@pytest.mark.parametrize("client", [*SYNC_CLIENTS, *ASYNC_CLIENTS])
async def test_a_session_through_each_client_stays_and_is_predicted(
    fleet: list[VllmEngine], caplog: pytest.LogCaptureFixture, client: str
) -> None:
    caplog.set_level(logging.INFO, logger="kvrouter.requests")
    async with (
        serve_router(real_config(fleet, "tokens")) as router,
        aiohttp.ClientSession() as http,
    ):
        replies = await run_session(client, router.url, f"{client}-s")
        assert len(replies) == TURNS
        lines = request_lines(caplog)
        assert [line["outcome"] for line in lines] == ["success"] * TURNS, lines
        assert len({line["worker"] for line in lines}) == 1, lines
        pairs = later_turns(lines)
        assert len(pairs) == TURNS - 1
        for predicted, cached in pairs:
            assert cached > 0, pairs
            assert abs(predicted - cached) <= BLOCK_TOKENS, (client, pairs, replies)
        failures = await metric(http, router, "kvrouter_requests_total") - await metric(
            http, router, "kvrouter_requests_total", outcome="success"
        )
        assert failures == 0


async def test_an_agent_session_calling_tools_is_read_and_predicted(
    fleet: list[VllmEngine], caplog: pytest.LogCaptureFixture
) -> None:
    """A coding agent's turns through the router to real vLLM (with its Hermes tool
    parser): each reply calls a tool (streamed, so the call comes as the engine parses
    it), the next turn carries the call and the tool's result. The router reads every
    turn's end as waiting on a tool, and predicts each later turn's cached tokens from
    the prompt and the call as the next turn renders it."""
    caplog.set_level(logging.INFO, logger="kvrouter.requests")
    session = "agent-tools"
    messages: list[Any] = [{"role": "user", "content": user_text(session, 0)}]
    tools: Any = list(AGENT_TOOLS)
    async with (
        serve_router(real_config(fleet, "tokens")) as router,
        aiohttp.ClientSession() as http,
        openai.AsyncOpenAI(base_url=router.url + "/v1", **client_options(session)) as client,
    ):
        for turn in range(TURNS):
            stream = await client.chat.completions.create(
                model=MODEL_NAME,
                messages=messages,
                tools=tools,
                tool_choice="required",
                max_tokens=REPLY_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "seed": 7},
            )
            head: tuple[str, str] | None = None
            arguments = []
            async for chunk in stream:
                for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    if call.id is not None and call.function is not None:
                        head = (call.id, call.function.name or "")
                    if call.function is not None and call.function.arguments:
                        arguments.append(call.function.arguments)
            assert head is not None, turn
            function = {"name": head[1], "arguments": "".join(arguments)}
            messages += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": head[0], "type": "function", "function": function}],
                },
                {"role": "tool", "tool_call_id": head[0], "content": user_text(session, turn + 1)},
            ]
        ends = await metric(http, router, "kvrouter_session_turn_ends_total", waiting_on="tool")
        back = await metric(http, router, "kvrouter_session_return_seconds_count", after="tool")
    assert (ends, back) == (TURNS, TURNS - 1)
    pairs = later_turns(request_lines(caplog))
    assert len(pairs) == TURNS - 1
    for predicted, cached in pairs:
        assert cached > 0 and abs(predicted - cached) <= BLOCK_TOKENS, pairs


async def wait_until(check: Callable[[], Any], timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def exact_everywhere(http: aiohttp.ClientSession, router: Any, names: list[str]) -> None:
    async def exact() -> bool:
        modes = [
            await metric(http, router, "kvrouter_prefix_mode", worker=name, mode="exact")
            for name in names
        ]
        return all(m == 1 for m in modes)

    await wait_until(exact)


async def test_exact_mode_predicts_what_the_engine_reports(
    fleet: list[VllmEngine], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvrouter.requests")
    async with (
        serve_router(real_config(fleet, "exact")) as router,
        aiohttp.ClientSession() as http,
    ):
        await exact_everywhere(http, router, [e.name for e in fleet])
        sessions = [f"exact{i}" for i in range(3)]
        await asyncio.gather(*(run_session("chat-sync-stream", router.url, s) for s in sessions))
        lines = request_lines(caplog)
    assert {line["outcome"] for line in lines} == {"success"}
    pairs = later_turns(lines)
    assert len(pairs) == len(sessions) * (TURNS - 1)
    assert all(cached > 0 for _, cached in pairs), pairs
    # No pressure (3 sessions of ~500 tokens in 2 x 4,096): within a block, every turn.
    assert all(abs(p - c) <= BLOCK_TOKENS for p, c in pairs), pairs


async def test_exact_mode_follows_an_evicting_engine_through_a_dropped_subscription(
    fleet: list[VllmEngine], caplog: pytest.LogCaptureFixture
) -> None:
    """Four sessions of ~1,300 tokens taking turns on one engine of 4,096: the engine
    evicts every round. The router's subscription runs through a proxy that is cut for a
    round: the batches published meanwhile are lost to it, and it replays them from the
    engine's replay endpoint when it hears the next one. Every turn after it has caught up
    is predicted within a block of what the engine reports."""
    engine = fleet[0]
    async with tcp_proxy(engine.events_port) as proxy, aiohttp.ClientSession() as http:
        endpoints = KvEventsEndpoints(f"tcp://127.0.0.1:{proxy.port}", engine.replay_endpoint)
        config = real_config(
            [engine],
            "exact",
            workers=(WorkerConfig(engine.url, name=engine.name, kv_events=endpoints),),
            # Gone before the next turn: what the router knows then, the events told it.
            kv_events=RouterKvEvents(speculative_ttl_s=0.1),
        )
        async with serve_router(config) as router:
            await exact_everywhere(http, router, [engine.name])

            async def replays() -> float:
                return await metric(
                    http, router, "kvrouter_kv_event_replays_total", worker=engine.name,
                    result="complete",
                )  # fmt: skip

            sessions = {
                f"evict{i}": [{"role": "user", "content": text_for(f"evict{i}", 1000)}]
                for i in range(4)
            }

            async def round_of_turns(turn: int) -> None:
                for key, messages in sessions.items():
                    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 8}
                    result = await post(http, router.url, {**body, "user": key})
                    assert result.status == 200, result.raw
                    messages += next_turn(key, turn, result.text)
                    await asyncio.sleep(0.3)  # the step's events reach the router

            caplog.set_level(logging.INFO, logger="kvrouter.requests")
            await round_of_turns(0)
            proxy.cut()
            await round_of_turns(1)  # unheard by the router
            before = await replays()
            proxy.restore()
            pokes = 0
            while await replays() == before:  # a batch it hears shows the gap
                pokes += 1  # a new prompt of whole blocks: the engine announces them
                poke = [{"role": "user", "content": text_for(f"poke{pokes}", 100)}]
                body = {"model": MODEL_NAME, "messages": poke, "max_tokens": 1}
                assert (await post(http, router.url, body)).status == 200
                await asyncio.sleep(0.3)
            await round_of_turns(2)
            await round_of_turns(3)
            removed = await metric(
                http, router, "kvrouter_kv_events_total", worker=engine.name, type="removed"
            )
    turns: dict[str, list[dict[str, Any]]] = {}
    for line in request_lines(caplog):
        turns.setdefault(line["session"], []).append(line)
    sessions_turns = [lines for lines in turns.values() if len(lines) == 4]
    assert len(sessions_turns) == len(sessions)
    caught_up = [line for lines in sessions_turns for line in lines[2:]]
    assert removed > 0  # the engine evicted, and the router heard it
    pairs = [(line["predicted_cached_tokens"], line["engine_cached_tokens"]) for line in caught_up]
    # Some session's history was evicted before its turn came round again.
    assert any(line["engine_cached_tokens"] < line["prompt_tokens"] // 2 for line in caught_up)
    assert all(abs(p - c) <= BLOCK_TOKENS for p, c in pairs), pairs


async def test_a_router_joining_late_replays_what_the_engines_hold(
    fleet: list[VllmEngine], caplog: pytest.LogCaptureFixture
) -> None:
    """The engines served a session before this router existed: its subscriber asks
    each engine's replay endpoint for what it missed and predicts the next turn."""
    caplog.set_level(logging.INFO, logger="kvrouter.requests")
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": user_text("late", 0)}],
        "max_tokens": 4,
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(fleet[0].url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            prompt_tokens = (await response.json())["usage"]["prompt_tokens"]
        config = real_config(fleet, "exact", policy="cache_aware")
        async with serve_router(config) as router:
            await exact_everywhere(http, router, [e.name for e in fleet])
            async with http.post(router.url + "/v1/chat/completions", json=body) as response:
                assert response.status == 200
                assert response.headers["X-Kvrouter-Worker"] == fleet[0].name
                usage = (await response.json())["usage"]
    (line,) = request_lines(caplog)
    held = prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS
    assert usage["prompt_tokens_details"]["cached_tokens"] == held
    assert line["predicted_cached_tokens"] == held


async def test_a_too_long_prompt_is_answered_in_the_engines_words(
    fleet: list[VllmEngine],
) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": text_for("long", 3000)}],
        "max_tokens": 4,
    }
    async with (
        serve_router(real_config(fleet, "tokens")) as router,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(fleet[0].url + "/v1/chat/completions", json=body) as response:
            direct = response.status, await response.json()
        async with http.post(router.url + "/v1/chat/completions", json=body) as response:
            routed = response.status, await response.json()
    assert direct[0] == 400
    assert routed == direct
    assert "maximum context length" in routed[1]["error"]["message"]


async def test_a_stored_response_is_continued_on_the_worker_that_holds_it(
    fleet: list[VllmEngine], caplog: pytest.LogCaptureFixture
) -> None:
    """Each continuation goes to the engine that stored the conversation, and is keyed as
    that conversation followed by its input: predicted as the engine reports it."""
    caplog.set_level(logging.INFO, logger="kvrouter.requests")
    async with (
        serve_router(real_config(fleet, "tokens", policy="round_robin")) as router,
        openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0) as client,
    ):
        first = await client.responses.with_raw_response.create(
            model=MODEL_NAME, input=user_text("stored", 0), max_output_tokens=8, store=True
        )
        holder = first.headers["X-Kvrouter-Worker"]
        previous = first.parse().id
        for turn in range(1, 4):  # round robin would send every other one elsewhere
            reply = await client.responses.with_raw_response.create(
                model=MODEL_NAME,
                input=user_text("stored", turn),
                previous_response_id=previous,
                max_output_tokens=8,
                store=True,
            )
            assert reply.headers["X-Kvrouter-Worker"] == holder
            parsed = reply.parse()
            assert parsed.usage is not None and parsed.usage.input_tokens_details.cached_tokens > 0
            previous = parsed.id
        fetched = await client.responses.retrieve(previous)
        assert fetched.id == previous
    pairs = [
        (line["predicted_cached_tokens"], line["engine_cached_tokens"])
        for line in request_lines(caplog)
    ]
    print("continuations, (predicted, engine-reported) cached tokens:", pairs[1:])
    assert len(pairs) == 4
    for predicted, cached in pairs[1:]:
        assert cached > 0 and abs(predicted - cached) <= BLOCK_TOKENS, pairs


async def test_a_cache_salt_keeps_prefixes_apart(
    fleet: list[VllmEngine], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvrouter.requests")
    messages = [{"role": "user", "content": user_text("salted", 0)}]
    async with (
        serve_router(real_config(fleet, "tokens")) as router,
        aiohttp.ClientSession() as http,
    ):
        cached = []
        for salt in ("tenant-a", "tenant-a", "tenant-b"):
            body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 4, "cache_salt": salt}
            async with http.post(router.url + "/v1/chat/completions", json=body) as response:
                assert response.status == 200
                usage = (await response.json())["usage"]
                cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    predicted = [line["predicted_cached_tokens"] for line in request_lines(caplog)]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0
    assert predicted == cached


def chat_request(messages: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": messages, "max_tokens": REPLY_TOKENS}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def test_two_replicas_over_one_redis_route_a_session_as_one(
    fleet: list[VllmEngine], redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each turn to the other replica the moment the last returned, with no session
    header: only what the replicas share through Redis keeps the session in place."""
    caplog.set_level(logging.INFO, logger="kvrouter.requests")
    state = StateConfig(url=redis_url, flush_interval_s=5.0, path_timeout_s=1.0)
    async with (
        serve_router(real_config(fleet, "tokens", state=state, seed=1)) as a,
        serve_router(real_config(fleet, "tokens", state=state, seed=2)) as b,
        aiohttp.ClientSession() as http,
    ):
        await met(http, a, b)
        for s in range(3):
            messages = [{"role": "user", "content": user_text(f"ryw{s}", 0)}]
            workers = []
            for turn in range(4):
                replica = (a, b)[turn % 2]
                result = await post(http, replica.url, chat_request(messages, stream=s % 2 == 0))
                assert result.status == 200, result.raw
                workers.append(result.worker)
                if turn:
                    assert result.cached > 0, (s, turn, result.usage)
                messages += [
                    {"role": "assistant", "content": result.text},
                    {"role": "user", "content": user_text(f"ryw{s}", turn + 1)},
                ]
            assert len(set(workers)) == 1, workers
    lines = request_lines(caplog)
    assert {line["outcome"] for line in lines} == {"success"}
    for predicted, cached in later_turns(lines):
        assert abs(predicted - cached) <= BLOCK_TOKENS, later_turns(lines)


async def test_a_router_keyed_by_blocks_the_engines_cannot_make_says_what_to_set(
    fleet: list[VllmEngine], caplog: pytest.LogCaptureFixture
) -> None:
    """CPU vLLM's blocks are 32 tokens; a token-mode router set to 64-token blocks
    (block_bytes 256) logs one WARNING a worker naming the number to set."""
    caplog.set_level(logging.WARNING, logger="router.fleet.health")
    prefix = PrefixConfig(block_bytes=256, tokenizer=str(fleet[0].model_dir))
    health = HealthConfig(interval_s=60.0, scrape_interval_s=0.2)
    async with serve_router(real_config(fleet, "tokens", prefix=prefix, health=health)):

        async def told() -> bool:
            return len(caplog.records) >= len(fleet)

        await wait_until(told)
        await asyncio.sleep(0.5)  # more scrapes: still once a worker
    messages = sorted(r.getMessage() for r in caplog.records)
    assert len(messages) == len(fleet), messages
    for engine, message in zip(fleet, messages, strict=True):
        assert message.startswith(f"worker {engine.name}: its engine's blocks are 32 tokens")
        assert "(set prefix.block_bytes: 128)" in message


# Last in the module: it leaves v1 without prompt-token details (the fixture restores it
# for whoever comes next).
async def test_a_restarted_engine_is_purged_and_one_without_cache_details_still_serves(
    fleet: list[VllmEngine], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvrouter.requests")
    engine = fleet[1]
    health = HealthConfig(interval_s=0.5, scrape_interval_s=0.5)
    async with (
        serve_router(real_config([engine], "tokens", health=health)) as router,
        aiohttp.ClientSession() as http,
    ):
        messages = [{"role": "user", "content": user_text("restart", 0)}]
        for turn in range(3):
            if turn == 2:
                engine.prompt_tokens_details = False
                await engine.restart()

                async def purged() -> bool:
                    restarts = await metric(http, router, "kvrouter_worker_restarts_total")
                    return restarts >= 1

                await wait_until(purged)
            result = await post(http, router.url, chat_request(messages, stream=True))
            assert result.status == 200, result.raw
            messages += [
                {"role": "assistant", "content": result.text},
                {"role": "user", "content": user_text("restart", turn + 1)},
            ]
        assert result.usage is not None
        assert (
            "prompt_tokens_details" not in result.usage or not result.usage["prompt_tokens_details"]
        )
    lines = request_lines(caplog)
    assert [line["outcome"] for line in lines] == ["success"] * 3
    assert lines[1]["predicted_cached_tokens"] > 0
    # The new process holds nothing, and the router knows it; the engine no longer says.
    assert lines[2]["predicted_cached_tokens"] == 0
    assert lines[2]["engine_cached_tokens"] is None
