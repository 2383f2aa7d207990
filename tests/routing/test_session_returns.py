"""What each turn's end leaves its session doing (waiting on a tool it called, on a
person, or finished), read from the reply, and how long sessions are away by each."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from tests.conftest import TEST_MODEL, EngineFactory, RunningRouter, router_config, serve_router
from tests.router_client import engines, metric

TOOLS: Any = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
CALL_TOOL: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required"}
# A reply that ends on its own (the seed fixes its natural length, well under the cap).
ENDS: dict[str, Any] = {"max_tokens": 1000, "seed": 1}


@pytest.fixture
async def router(engine_factory: EngineFactory) -> AsyncIterator[RunningRouter]:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet)) as running,
    ):
        yield running


async def test_the_simulated_engine_calls_the_function_tool_choice_asks_for(
    router: RunningRouter,
) -> None:
    messages: Any = [{"role": "user", "content": "read a.py"}]
    async with openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="x") as client:
        whole = await client.chat.completions.create(
            model=TEST_MODEL, messages=messages, **ENDS, **CALL_TOOL
        )
        stream = await client.chat.completions.create(
            model=TEST_MODEL, messages=messages, stream=True, **ENDS, **CALL_TOOL
        )
        pieces, names, finish = [], [], None
        async for chunk in stream:
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or ():
                assert call.function is not None
                names.append(call.function.name)
                pieces.append(call.function.arguments or "")
    call = (whole.choices[0].message.tool_calls or [None])[0]
    assert call is not None and call.type == "function" and call.function.name == "read_file"
    assert whole.choices[0].finish_reason == "tool_calls"
    assert set(orjson.loads(call.function.arguments)) == {"input"}
    assert names[0] == "read_file" and finish == "tool_calls"
    assert set(orjson.loads("".join(pieces))) == {"input"}
    # As vLLM: a named call ends "stop", a call cut by max_tokens "length"; a function
    # not among the tools is refused (tests/real/test_sim_vs_vllm.py compares the shapes).
    named: Any = {"type": "function", "function": {"name": "read_file"}}
    async with openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="x") as client:
        stopped = await client.chat.completions.create(
            model=TEST_MODEL, messages=messages, tools=TOOLS, tool_choice=named, **ENDS
        )
        cut = await client.chat.completions.create(
            model=TEST_MODEL,
            messages=messages,
            max_tokens=12,
            extra_body={"ignore_eos": True},  # exactly max_tokens: cut
            **CALL_TOOL,
        )
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model=TEST_MODEL,
                messages=messages,
                max_tokens=12,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "rm"}},
            )
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].message.tool_calls
    # A whole reply cut before its call was complete carries the raw text, no call.
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    assert (cut.choices[0].message.content or "").startswith("<tool_call>")


async def test_a_session_is_away_by_what_its_last_turn_left_it_waiting_on(
    router: RunningRouter,
) -> None:
    async def turn(history: list[Any], session: str, **extra: Any) -> None:
        headers = {"X-Session-Id": session, **extra.pop("headers", {})}
        async with openai.AsyncOpenAI(
            base_url=f"{router.url}/v1", api_key="x", default_headers=headers
        ) as client:
            reply = await client.chat.completions.create(
                model=TEST_MODEL, messages=history, **{"max_tokens": 8, **extra}
            )
        message = reply.choices[0].message
        history.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or ():
            history.append({"role": "tool", "tool_call_id": call.id, "content": "print(1)"})

    agent: list[Any] = [{"role": "user", "content": "fix the bug in a.py"}]
    await turn(agent, "agent", **CALL_TOOL, **ENDS)  # calls a tool: back when it returns
    await turn(agent, "agent")  # answers: waits for the person
    agent.append({"role": "user", "content": "thanks, that is all"})
    await turn(agent, "agent", headers={"X-Session-End": "true"})  # its last
    chat: list[Any] = [{"role": "user", "content": "hello"}]
    await turn(chat, "chat")
    chat.append({"role": "user", "content": "and again"})
    await turn(chat, "chat")
    async with aiohttp.ClientSession() as http:

        async def returns(after: str) -> float:
            name = "kvrouter_session_return_seconds_count"
            return await metric(http, router, name, after=after)

        async def ends(waiting_on: str) -> float:
            name = "kvrouter_session_turn_ends_total"
            return await metric(http, router, name, waiting_on=waiting_on)

        assert [await returns(a) for a in ("tool", "user", "finished")] == [1, 2, 0]
        assert [await ends(w) for w in ("tool", "user", "finished")] == [1, 3, 1]


async def test_a_turn_without_usage_still_says_when_its_session_is_back(
    router: RunningRouter,
) -> None:
    """A stream without stream_options.include_usage carries no usage: the turn's end
    and the session's return are known all the same."""
    messages: Any = [{"role": "user", "content": "hello"}]
    headers = {"X-Session-Id": "no-usage"}
    async with openai.AsyncOpenAI(
        base_url=f"{router.url}/v1", api_key="x", default_headers=headers
    ) as client:
        for _ in range(2):
            stream = await client.chat.completions.create(
                model=TEST_MODEL, messages=messages, stream=True, **CALL_TOOL, **ENDS
            )
            async for chunk in stream:
                assert chunk.usage is None
    async with aiohttp.ClientSession() as http:
        name = "kvrouter_session_return_seconds_count"
        assert await metric(http, router, name, after="tool") == 1
