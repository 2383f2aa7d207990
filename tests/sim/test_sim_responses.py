"""The simulated vLLM engine's Responses API (``POST /v1/responses``, ``GET
/v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``) driven by the real ``openai``
SDK over loopback HTTP, behind each front-end: a request becomes the chat request vLLM
renders it to (instructions, the stored conversation of ``previous_response_id``, the
input), so its prompt counts and caches as the chat path's does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from bench.sim.responses_request import parse, sampling
from bench.textgen import text_for
from tests.conftest import TEST_MODEL, RunningEngine, engine_config
from tests.sim_servers import FRONTS, serve_engine_on

BLOCK = 16
SYSTEM = text_for("sys", 300)
QUESTION = text_for("u1", 40)
FOLLOW_UP = text_for("u2", 20)
EXACT = {"ignore_eos": True}  # vLLM's extra field: exactly max_output_tokens tokens


@pytest.fixture(params=FRONTS)
def front(request: pytest.FixtureRequest) -> str:
    param: str = request.param
    return param


@pytest.fixture
async def sim(front: str) -> AsyncIterator[RunningEngine]:
    async with serve_engine_on(front, engine_config(responses_store=True)) as running:
        yield running


def sdk(sim: RunningEngine) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0)


@pytest.fixture
async def client(sim: RunningEngine) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk(sim) as made:
        yield made


async def http(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else orjson.dumps(body)
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, data=data) as response,
    ):
        raw = await response.read()
        return response.status, orjson.loads(raw) if raw else None


async def chat_usage(sim: RunningEngine, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The usage the chat path reports for ``messages``."""
    body = {"messages": messages, "max_tokens": 1}
    status, answer = await http("POST", f"{sim.url}/v1/chat/completions", body)
    assert status == 200, answer
    usage: dict[str, Any] = answer["usage"]
    return usage


async def chat_prompt_tokens(sim: RunningEngine, messages: list[dict[str, Any]]) -> int:
    tokens: int = (await chat_usage(sim, messages))["prompt_tokens"]
    return tokens


FIRST_TURN = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


async def test_create_answers_with_a_response(
    sim: RunningEngine, client: openai.AsyncOpenAI
) -> None:
    response = await client.responses.create(
        model=TEST_MODEL,
        instructions=SYSTEM,
        input=QUESTION,
        max_output_tokens=12,
        extra_body=EXACT,
    )
    assert response.id.startswith("resp_") and len(response.id) == len("resp_") + 16
    assert (response.object, response.model) == ("response", TEST_MODEL)
    [item] = response.output
    assert item.type == "message" and item.id.startswith("msg_") and len(item.id) == 20
    assert len(response.output_text) == 12 * 4  # stand-in tokens are 4 bytes
    # The output hit max_output_tokens: vLLM's "incomplete"; 0.32's item says "completed".
    assert response.status == "incomplete" and item.status == "completed"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.max_output_tokens == 12 and response.instructions == SYSTEM
    usage = response.usage
    assert usage is not None
    prompt = await chat_prompt_tokens(sim, FIRST_TURN)
    assert usage.input_tokens == prompt  # the whole prompt, as vLLM counts it
    assert usage.input_tokens_details.cached_tokens == 0  # a fresh engine
    assert usage.output_tokens == 12 and usage.total_tokens == prompt + 12
    assert usage.output_tokens_details.reasoning_tokens == 0
    written = usage.input_tokens_details.model_dump()["cache_write_tokens"]
    assert written == prompt // BLOCK * BLOCK


async def test_the_body_is_vllms(sim: RunningEngine) -> None:
    """Every field of vLLM's ResponsesResponse, nulls included; the id from the
    ``request_id`` extra field."""
    body = {"model": TEST_MODEL, "input": "hi", "max_output_tokens": 3, "request_id": "resp_abc"}
    status, answer = await http("POST", f"{sim.url}/v1/responses", {**body, **EXACT})
    assert status == 200
    assert list(answer) == [
        *("id", "created_at", "incomplete_details", "instructions", "metadata", "model"),
        *("object", "output", "parallel_tool_calls", "temperature", "tool_choice", "tools"),
        *("top_p", "background", "max_output_tokens", "max_tool_calls"),
        *("previous_response_id", "prompt", "reasoning", "service_tier"),
        *("status", "text", "top_logprobs", "truncation", "usage", "user"),
        *("presence_penalty", "frequency_penalty", "kv_transfer_params"),
        *("ec_transfer_params", "input_messages", "output_messages"),
    ]
    assert answer["id"] == "resp_abc" and answer["tool_choice"] == "none"
    assert answer["status"] == "incomplete"
    assert answer["incomplete_details"] == {"reason": "max_output_tokens"}
    assert answer["output"][0]["status"] == "completed"
    # vLLM's neutral sampling: the stand-in model has no generation_config.json.
    sampling = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
    assert [answer[name] for name in sampling] == [1.0, 1.0, 0.0, 0.0]
    assert answer["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert answer["usage"]["output_tokens_details"]["tool_output_tokens"] == 0


STREAM_TYPES = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_END = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",  # vLLM 0.32 sends no response.incomplete
]


async def test_stream_events_in_order(sim: RunningEngine, client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(
        model=TEST_MODEL,
        instructions=SYSTEM,
        input=QUESTION,
        max_output_tokens=30,
        stream=True,
        extra_body=EXACT,
    )
    events = [event async for event in stream]
    types = [event.type for event in events]
    deltas = len(types) - len(STREAM_TYPES) - len(STREAM_END)
    assert deltas >= 1
    assert types == [*STREAM_TYPES, *["response.output_text.delta"] * deltas, *STREAM_END]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    created, in_progress, added = events[0], events[1], events[2]
    assert created.type == "response.created" and in_progress.type == "response.in_progress"
    assert created.response.status == "in_progress" and created.response.output == []
    assert created.response.usage is None
    final = events[-1]
    assert final.type == "response.completed"
    assert final.response.status == "incomplete"
    assert final.response.incomplete_details is not None
    assert final.response.incomplete_details.reason == "max_output_tokens"
    assert final.response.id == created.response.id == in_progress.response.id
    assert added.type == "response.output_item.added"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert len(text) == 30 * 4 and final.response.output_text == text
    [item] = final.response.output
    assert item.type == "message" and item.id == added.item.id and item.status == "completed"
    usage = final.response.usage
    assert usage is not None and usage.output_tokens == 30
    assert usage.input_tokens == await chat_prompt_tokens(sim, FIRST_TURN)


async def test_stream_accumulates_in_the_sdk(client: openai.AsyncOpenAI) -> None:
    """The SDK's own stream state (event order, ids, items) accepts the stream, and a
    natural-length answer ends ``completed`` or ``incomplete`` by its finish."""
    pieces: list[str] = []
    async with client.responses.stream(
        model=TEST_MODEL, input=QUESTION, max_output_tokens=2000
    ) as stream:
        async for event in stream:
            if event.type == "response.output_text.delta":
                pieces.append(event.delta)
        final = await stream.get_final_response()
    assert pieces and "".join(pieces) == final.output_text
    usage = final.usage
    assert usage is not None and usage.output_tokens * 4 == len(final.output_text)
    assert final.status == ("incomplete" if usage.output_tokens == 2000 else "completed")


async def test_a_second_turn_extends_the_first_and_reads_it_from_the_cache(
    sim: RunningEngine, client: openai.AsyncOpenAI
) -> None:
    first = await client.responses.create(
        model=TEST_MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=16
    )
    second = await client.responses.create(
        model=TEST_MODEL,
        instructions=SYSTEM,
        input=FOLLOW_UP,
        previous_response_id=first.id,
        max_output_tokens=16,
    )
    assert second.previous_response_id == first.id
    assert first.usage is not None and second.usage is not None
    # The prompt is the first turn's conversation, its answer, then the new input.
    conversation = [
        *FIRST_TURN,
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": FOLLOW_UP},
    ]
    assert second.usage.input_tokens == await chat_prompt_tokens(sim, conversation)
    read = second.usage.input_tokens_details.cached_tokens
    # The first turn's prompt in full blocks, at least.
    assert read >= first.usage.input_tokens // BLOCK * BLOCK - BLOCK
    assert read > 300 and read % BLOCK == 0
    # A third turn without instructions: they do not carry over; the turns before do.
    third = await client.responses.create(
        model=TEST_MODEL, input="and?", previous_response_id=second.id, max_output_tokens=4
    )
    assert third.usage is not None
    carried = [
        *conversation[1:],
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "and?"},
    ]
    assert third.usage.input_tokens == await chat_prompt_tokens(sim, carried)


async def test_input_items_render_as_their_chat_messages(
    sim: RunningEngine, client: openai.AsyncOpenAI
) -> None:
    response = await client.responses.create(
        model=TEST_MODEL,
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "id": "msg_1",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
            },
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        ],
        max_output_tokens=4,
    )
    chat: list[dict[str, Any]] = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "Sunny", "tool_call_id": "c1"},
    ]
    assert response.usage is not None
    assert response.usage.input_tokens == await chat_prompt_tokens(sim, chat)


async def test_the_sampling_echoed_is_the_requests_else_the_models(
    sim: RunningEngine, tmp_path: Path
) -> None:
    (tmp_path / "generation_config.json").write_bytes(
        orjson.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True})
    )
    request = parse({"input": "hi", "temperature": "0.3", "presence_penalty": 1})
    assert sampling(request, str(tmp_path)) == {
        "temperature": 0.3,
        "top_p": 0.95,
        "presence_penalty": 1.0,
        "frequency_penalty": 0.0,
    }
    assert sampling(request, None)["top_p"] == 1.0
    body = {"model": TEST_MODEL, "input": "hi", "max_output_tokens": 2, "top_p": 0.5}
    status, answer = await http("POST", f"{sim.url}/v1/responses", body)
    assert status == 200 and (answer["temperature"], answer["top_p"]) == (1.0, 0.5)
    status, answer = await http("POST", f"{sim.url}/v1/responses", {**body, "top_p": "x"})
    assert status == 400 and answer["error"]["param"] == "body.top_p"


async def test_max_output_tokens_past_the_context_is_a_400(front: str) -> None:
    """Up to max_model_len it is clamped to what the prompt leaves; past it, a 400."""
    limit = 64
    async with serve_engine_on(front, engine_config(max_model_len=limit)) as short:
        body = {"model": TEST_MODEL, "input": "hi", "max_output_tokens": limit + 1}
        status, answer = await http("POST", f"{short.url}/v1/responses", body)
        assert status == 400
        assert answer["error"] == {
            "message": f"max_output_tokens={limit + 1} cannot be greater than max_model_len="
            f"{limit}. Please request fewer output tokens. (parameter=max_output_tokens, "
            f"value={limit + 1})",
            "type": "BadRequestError",
            "param": "max_output_tokens",
            "code": 400,
        }
        status, answer = await http(
            "POST", f"{short.url}/v1/responses", {**body, **EXACT, "max_output_tokens": limit}
        )
        assert status == 200
        prompt = await chat_prompt_tokens(short, [{"role": "user", "content": "hi"}])
        assert answer["max_output_tokens"] == answer["usage"]["output_tokens"] == limit - prompt


async def test_unsupported_input_item_is_a_400(sim: RunningEngine) -> None:
    body = {"model": TEST_MODEL, "input": [{"type": "image_generation_call", "id": "x"}]}
    status, answer = await http("POST", f"{sim.url}/v1/responses", body)
    assert status == 400
    assert answer["error"]["message"] == "Unsupported input item type: image_generation_call"


async def test_stored_responses_are_retrieved(client: openai.AsyncOpenAI) -> None:
    whole = await client.responses.create(model=TEST_MODEL, input=QUESTION, max_output_tokens=5)
    assert (await client.responses.retrieve(whole.id)).model_dump() == whole.model_dump()
    stream = await client.responses.create(
        model=TEST_MODEL, input=QUESTION, max_output_tokens=5, stream=True, extra_body=EXACT
    )
    last = [event async for event in stream][-1]
    # A stream cut at max_output_tokens ends with response.completed all the same.
    assert last.type == "response.completed" and last.response.status == "incomplete"
    streamed = last.response
    got = await client.responses.retrieve(streamed.id)
    assert got.output[0].id == streamed.output[0].id
    assert got.output_text == streamed.output_text and got.status == streamed.status
    # store: false is not kept.
    unstored = await client.responses.create(
        model=TEST_MODEL, input=QUESTION, max_output_tokens=5, store=False
    )
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)


async def test_unknown_ids_are_404(sim: RunningEngine, client: openai.AsyncOpenAI) -> None:
    expected = {
        "message": "Response with id 'resp_nope' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }
    for method, path in (("GET", "resp_nope"), ("POST", "resp_nope/cancel")):
        status, answer = await http(method, f"{sim.url}/v1/responses/{path}")
        assert (status, answer) == (404, {"error": expected})
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(
            model=TEST_MODEL, input="hi", previous_response_id="resp_nope"
        )
    assert sim.engine.requests.as_dict()["requests"] == []  # nothing reached the engine


async def test_a_finished_response_cannot_be_cancelled(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(model=TEST_MODEL, input="hi", max_output_tokens=3)
    with pytest.raises(openai.BadRequestError) as raised:
        await client.responses.cancel(response.id)
    assert raised.value.status_code == 400
    assert raised.value.body == {
        "message": "Cannot cancel a synchronous response.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 400,
    }
    assert (await client.responses.retrieve(response.id)).status == response.status


async def test_with_the_store_off_nothing_is_kept(front: str) -> None:
    async with serve_engine_on(front, engine_config()) as off, sdk(off) as client:
        response = await client.responses.create(model=TEST_MODEL, input="hi", max_output_tokens=3)
        assert response.output_text
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.cancel(response.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(
                model=TEST_MODEL, input="more", previous_response_id=response.id
            )
        with pytest.raises(openai.BadRequestError) as raised:
            await client.responses.create(model=TEST_MODEL, input="hi", background=True)
        assert "VLLM_ENABLE_RESPONSES_API_STORE=1" in str(raised.value)
        assert len(off.engine.responses) == 0


async def test_the_store_forgets_the_oldest(front: str) -> None:
    config = engine_config(responses_store=True, responses_store_max=2)
    async with serve_engine_on(front, config) as bounded, sdk(bounded) as client:
        ids = [
            (await client.responses.create(model=TEST_MODEL, input=f"q{i}", max_output_tokens=2)).id
            for i in range(3)
        ]
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(ids[0])
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(
                model=TEST_MODEL, input="more", previous_response_id=ids[0]
            )
        for rid in ids[1:]:
            assert (await client.responses.retrieve(rid)).id == rid
        assert len(bounded.engine.responses) == 2


async def test_path_parameters_route_as_aiohttp_does(sim: RunningEngine) -> None:
    """404 and 405 on the parameter routes alike behind both front-ends."""
    cases = {
        ("GET", "/v1/responses/"): 404,
        ("GET", "/v1/responses/a/b"): 404,
        ("POST", "/v1/responses/a"): 405,
        ("GET", "/v1/responses/a/cancel"): 405,
        ("GET", "/v1/responses"): 405,
    }
    for (method, path), expected in cases.items():
        status, _ = await http(method, f"{sim.url}{path}")
        assert status == expected, (method, path)
