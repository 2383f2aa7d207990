"""The simulated vLLM engine's Anthropic Messages API (``/v1/messages`` and
``/v1/messages/count_tokens``) driven by the real ``anthropic`` SDK over loopback HTTP,
behind each front-end: the conversation becomes the chat request vLLM runs, so its prompt
counts and caches as the chat path's does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import orjson
import pytest

from bench.textgen import text_for
from tests.conftest import TEST_MODEL, RunningEngine

BLOCK = 16
SYSTEM = text_for("sys", 300)
QUESTION = text_for("u1", 40)


@pytest.fixture
async def client(sim: RunningEngine) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=sim.url, api_key="x", max_retries=0) as made:
        yield made


async def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, data=orjson.dumps(body), headers=headers) as response,
    ):
        return response.status, await response.read()


async def chat_usage(sim: RunningEngine, body: dict[str, Any]) -> dict[str, Any]:
    """The usage the chat path reports for ``body`` (a chat completion)."""
    status, raw = await post(f"{sim.url}/v1/chat/completions", {**body, "max_tokens": 1})
    assert status == 200, raw
    usage: dict[str, Any] = orjson.loads(raw)["usage"]
    return usage


async def chat_prompt_tokens(sim: RunningEngine, body: dict[str, Any]) -> int:
    """The prompt tokens the chat path counts for ``body``."""
    tokens: int = (await chat_usage(sim, body))["prompt_tokens"]
    return tokens


CACHE_KEYS = ("cache_creation_input_tokens", "cache_read_input_tokens")


def prompt_total(usage: anthropic.types.Usage) -> int:
    return (
        usage.input_tokens
        + (usage.cache_read_input_tokens or 0)
        + (usage.cache_creation_input_tokens or 0)
    )


async def test_create_answers_with_a_message(
    sim: RunningEngine, client: anthropic.AsyncAnthropic
) -> None:
    message = await client.messages.create(
        model=TEST_MODEL,
        max_tokens=12,
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
        extra_body={"min_tokens": 12},  # vLLM's extra field: exactly 12 tokens
    )
    chat = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    }
    assert message.id.startswith("chatcmpl-") and len(message.id) == len("chatcmpl-") + 16
    assert (message.type, message.role, message.model) == ("message", "assistant", TEST_MODEL)
    assert len(message.content) == 1 and message.content[0].type == "text"
    assert len(message.content[0].text) == 12 * 4  # stand-in tokens are 4 bytes
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage = message.usage
    assert usage.output_tokens == 12
    prompt = await chat_prompt_tokens(sim, chat)
    # A fresh engine: nothing read, the prompt's full blocks written.
    assert usage.cache_read_input_tokens == 0
    assert usage.cache_creation_input_tokens == prompt // BLOCK * BLOCK
    assert prompt_total(usage) == prompt


async def test_the_body_is_vllms(sim: RunningEngine) -> None:
    """No null ``stop_sequence`` (vLLM dumps without nulls); the id from X-Request-Id."""
    body = {"model": TEST_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    status, raw = await post(f"{sim.url}/v1/messages", body, {"X-Request-Id": "abc"})
    assert status == 200
    message = orjson.loads(raw)
    assert list(message) == ["id", "type", "role", "content", "model", "stop_reason", "usage"]
    assert message["id"] == "chatcmpl-abc"
    assert list(message["usage"]) == [
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
    ]


async def test_stream_accumulates_text_and_usage(
    sim: RunningEngine, client: anthropic.AsyncAnthropic
) -> None:
    pieces: list[str] = []
    async with client.messages.stream(
        model=TEST_MODEL,
        max_tokens=30,
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
        extra_body={"min_tokens": 30},
    ) as stream:
        async for text in stream.text_stream:
            pieces.append(text)
        final = await stream.get_final_message()
    [block] = final.content
    assert block.type == "text"
    assert pieces and "".join(pieces) == block.text
    assert len(block.text) == 30 * 4
    assert final.id.startswith("chatcmpl-")
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 30
    chat = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    }
    assert prompt_total(final.usage) == await chat_prompt_tokens(sim, chat)


async def test_stream_events_are_vllms(sim: RunningEngine) -> None:
    """``event:`` lines in vLLM's order, one text block, no ping and no [DONE]."""
    body = {
        "model": TEST_MODEL,
        "max_tokens": 8,
        "min_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{sim.url}/v1/messages", json=body) as response,
    ):
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        raw = await response.read()
    frames = [frame.split(b"\n") for frame in raw.split(b"\n\n") if frame]
    names = [lines[0].removeprefix(b"event: ").decode() for lines in frames]
    data = [orjson.loads(lines[1].removeprefix(b"data: ")) for lines in frames]
    assert all(len(lines) == 2 for lines in frames)
    deltas = len(names) - 5
    assert deltas >= 1
    assert names == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [d["type"] for d in data] == names
    start = data[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and "stop_sequence" in start
    assert data[1] == {
        "type": "content_block_start",
        "content_block": {"type": "text", "text": ""},
        "index": 0,
    }
    text = "".join(d["delta"]["text"] for d in data[2 : 2 + deltas])
    assert len(text) == 8 * 4
    assert data[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    end_usage = data[-2]["usage"]
    assert end_usage["output_tokens"] == 8
    # message_start has the first chat chunk's usage: the whole prompt, no cache split.
    prompt = sum(end_usage[key] for key in ("input_tokens", *CACHE_KEYS))
    assert start["usage"] == {"input_tokens": prompt, "output_tokens": 0}


async def test_a_second_turn_reads_the_first_from_the_cache(
    client: anthropic.AsyncAnthropic,
) -> None:
    first_turn: list[anthropic.types.MessageParam] = [{"role": "user", "content": QUESTION}]
    first = await client.messages.create(
        model=TEST_MODEL, max_tokens=16, system=SYSTEM, messages=first_turn
    )
    assert first.usage.cache_read_input_tokens == 0
    reply = first.content[0]
    assert reply.type == "text"
    second_turn: list[anthropic.types.MessageParam] = [
        *first_turn,
        {"role": "assistant", "content": reply.text},
        {"role": "user", "content": text_for("u2", 20)},
    ]
    second = await client.messages.create(
        model=TEST_MODEL, max_tokens=16, system=SYSTEM, messages=second_turn
    )
    counted = await client.messages.count_tokens(
        model=TEST_MODEL, system=SYSTEM, messages=second_turn
    )
    read = second.usage.cache_read_input_tokens or 0
    # The first turn's prompt (the system text and the question) in full blocks, at least.
    assert read >= prompt_total(first.usage) // BLOCK * BLOCK - BLOCK
    assert read > 300 and read % BLOCK == 0
    assert prompt_total(second.usage) == counted.input_tokens


TOOLS: list[anthropic.types.ToolParam] = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
TOOL_TURN: list[anthropic.types.MessageParam] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "get_weather",
                "input": {"city": "Paris"},
            },
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"},
            {"type": "text", "text": "Thanks! And tomorrow?"},
        ],
    },
]
# The chat messages vLLM converts SYSTEM_BLOCKS and TOOL_TURN to (§1.2).
SYSTEM_BLOCKS: list[anthropic.types.TextBlockParam] = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
    {"type": "text", "text": "You are a weather bot. "},
    {"type": "text", "text": "Be brief."},
]
CHAT_TURN = [
    {"role": "system", "content": "You are a weather bot. Be brief."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "toolu_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"},
    {"role": "user", "content": "Thanks! And tomorrow?"},
]


async def test_tool_use_and_tool_result_count_as_their_chat_messages(
    sim: RunningEngine, client: anthropic.AsyncAnthropic
) -> None:
    message = await client.messages.create(
        model=TEST_MODEL, max_tokens=8, system=SYSTEM_BLOCKS, messages=TOOL_TURN, tools=TOOLS
    )
    counted = await client.messages.count_tokens(
        model=TEST_MODEL, system=SYSTEM_BLOCKS, messages=TOOL_TURN, tools=TOOLS
    )
    chat_tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": TOOLS[0]["input_schema"],
            },
        }
    ]
    chat = await chat_usage(sim, {"messages": CHAT_TURN, "tools": chat_tools})
    assert counted.input_tokens == chat["prompt_tokens"] == prompt_total(message.usage)
    # The same prompt, token for token: the chat request reads all but its last token's
    # block from the cache the Messages request wrote.
    prompt = chat["prompt_tokens"]
    assert chat["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // BLOCK * BLOCK
    assert message.content[0].type == "text" and message.content[0].text


async def test_count_tokens_answers_as_vllm(sim: RunningEngine) -> None:
    body = {"model": TEST_MODEL, "messages": [{"role": "user", "content": QUESTION}]}
    status, raw = await post(f"{sim.url}/v1/messages/count_tokens", body)
    assert status == 200
    chat = await chat_prompt_tokens(sim, {"messages": body["messages"]})
    assert orjson.loads(raw) == {
        "input_tokens": chat,
        "context_management": {"original_input_tokens": chat},
    }


async def test_a_missing_max_tokens_is_an_openai_shaped_400(sim: RunningEngine) -> None:
    body = {"model": TEST_MODEL, "messages": [{"role": "user", "content": "hi"}]}
    status, raw = await post(f"{sim.url}/v1/messages", body)
    assert status == 400
    error = orjson.loads(raw)
    assert list(error) == ["error"]
    assert error["error"]["type"] == "Bad Request"
    assert error["error"]["param"] == "body.max_tokens"
    assert error["error"]["code"] == 400
    assert error["error"]["message"].startswith("1 validation error:")
    assert sim.engine.requests.as_dict()["requests"] == []  # nothing reached the engine


async def test_an_unknown_model_is_an_anthropic_shaped_404(
    client: anthropic.AsyncAnthropic,
) -> None:
    """vLLM 0.32 keeps its own error type (``NotFoundError``) in Anthropic's shape."""
    with pytest.raises(anthropic.NotFoundError) as created:
        await client.messages.create(
            model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(anthropic.NotFoundError) as counted:
        await client.messages.count_tokens(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    for raised in (created.value, counted.value):
        assert raised.status_code == 404
        assert isinstance(raised.body, dict) and list(raised.body) == ["type", "error"]
        assert raised.body["type"] == "error"
        error = raised.body["error"]
        assert list(error) == ["type", "message"] and error["type"] == "NotFoundError"
        assert error["message"].startswith("The model `no-such-model` does not exist.")


async def test_asking_past_the_context_is_a_bad_request_error(sim: RunningEngine) -> None:
    body = {
        "model": TEST_MODEL,
        "max_tokens": sim.engine.max_model_len + 1,
        "messages": [{"role": "user", "content": "hi"}],
    }
    status, raw = await post(f"{sim.url}/v1/messages", body)
    assert status == 400
    error = orjson.loads(raw)
    assert error["type"] == "error" and error["error"]["type"] == "BadRequestError"
