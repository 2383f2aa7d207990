"""The replay through each API it speaks (``--api chat|responses|messages``): the bodies,
reading each stream, and replays against the real simulated engine on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path

import pytest
from aiohttp import web

from bench.replay.api_streams import (
    READERS,
    MessagesStream,
    ResponsesStream,
    StreamOutcome,
)
from bench.replay.client import ChatClient, open_http_session
from bench.replay.conversation import tokenize_prompt
from bench.replay.result import (
    RequestRecord,
    RunMeta,
    RunResult,
    result_from_json,
    result_to_json,
)
from bench.replay.runner import ReplayConfig, replay, select_sessions
from bench.replay.sse import SseEvent
from bench.tokenizer import num_tokens
from bench.workloads.api_bodies import (
    APIS,
    PATHS,
    Api,
    ChatRequest,
    chat_body,
    messages_body,
    responses_body,
)
from bench.workloads.trace import TextBlock, Turn
from tests.conftest import TEST_MODEL, EngineFactory

TIME_SCALE = 50.0
OUTPUT_TOKENS = 24

CONVERSATION: tuple[Mapping[str, str], ...] = (
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "again"},
)


# --- bodies -------------------------------------------------------------------------------


def test_chat_body_is_the_messages_as_they_are() -> None:
    body = chat_body("m", ChatRequest("s1", CONVERSATION, 7))
    assert body == {
        "model": "m",
        "messages": list(CONVERSATION),
        "max_tokens": 7,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "s1",
    }


def test_responses_body_has_instructions_and_assistant_output_items() -> None:
    body = responses_body("m", ChatRequest("s1", CONVERSATION, 7))
    assert body == {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "hi"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "hello"}],
            },
            {"role": "user", "content": "again"},
        ],
        "max_output_tokens": 7,
        "stream": True,
        "store": False,
        "ignore_eos": True,
        "user": "s1",
    }


def test_messages_body_has_system_and_plain_turns() -> None:
    body = messages_body("m", ChatRequest("s1", CONVERSATION, 7))
    assert body == {
        "model": "m",
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"},
        ],
        "max_tokens": 7,
        "stream": True,
        "ignore_eos": True,
        # vLLM's Anthropic request ignores ignore_eos; min_tokens pins the length.
        "min_tokens": 7,
        "metadata": {"user_id": "s1"},
    }


def test_bodies_without_a_system_message_have_no_instructions_or_system() -> None:
    request = ChatRequest("s1", CONVERSATION[1:2], 3)
    assert "instructions" not in responses_body("m", request)
    assert "system" not in messages_body("m", request)
    assert responses_body("m", request)["input"] == [{"role": "user", "content": "hi"}]
    assert messages_body("m", request)["messages"] == [{"role": "user", "content": "hi"}]


def test_replay_config_refuses_an_unknown_api() -> None:
    with pytest.raises(ValueError, match="api must be one of chat, responses, messages"):
        ReplayConfig(target="http://x", trace=Path("t"), api="grpc")  # type: ignore[arg-type]


def test_the_api_is_in_the_run_meta_and_old_results_read_as_chat() -> None:
    meta = RunMeta("http://x", "t", "m", 1.0, 1, "2025-01-01T00:00:00+00:00", 1.0, "messages")
    obj = result_to_json(RunResult(meta, ()))
    assert obj["meta"]["api"] == "messages"
    del obj["meta"]["api"]  # a result written before the field existed
    assert result_from_json(obj).meta.api == "chat"


# --- reading the streams, event by event --------------------------------------------------


def _feed(api: Api, events: list[tuple[str, str]]) -> tuple[StreamOutcome, bool, str]:
    """Feed ``(event name, data)`` pairs to a fresh reader at 1 s, 2 s, ...: the outcome,
    whether the reader saw the stream's end, and the reply."""
    outcome = StreamOutcome()
    reader = READERS[api](outcome)
    for index, (name, data) in enumerate(events):
        if reader.feed(SseEvent(name, data), float(index + 1)):
            return outcome, True, reader.reply()
    return outcome, False, reader.reply()


_RESPONSE_USAGE = (
    '{"input_tokens":40,"input_tokens_details":{"cached_tokens":32,"cache_write_tokens":0},'
    '"output_tokens":3}'
)


def test_responses_stream_reads_deltas_and_the_terminal_usage() -> None:
    events = [
        ("response.created", '{"type":"response.created","response":{"usage":null}}'),
        ("response.in_progress", '{"type":"response.in_progress","response":{}}'),
        ("response.output_text.delta", '{"type":"response.output_text.delta","delta":""}'),
        ("response.output_text.delta", '{"type":"response.output_text.delta","delta":"ab"}'),
        ("response.output_text.delta", '{"type":"response.output_text.delta","delta":"c"}'),
        ("response.output_text.done", '{"type":"response.output_text.done","text":"abc"}'),
        (
            "response.incomplete",
            '{"type":"response.incomplete","response":{"usage":' + _RESPONSE_USAGE + "}}",
        ),
    ]
    outcome, ended, reply = _feed("responses", events)
    assert ended and outcome.error is None
    assert reply == "abc"
    assert outcome.ttft_s == 4.0  # the first non-empty delta
    assert (outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens) == (40, 32, 3)


def test_responses_stream_failures() -> None:
    failed = '{"type":"response.failed","response":{"error":{"message":"oom"}}}'
    outcome, ended, _ = _feed("responses", [("response.failed", failed)])
    assert ended and outcome.error == "response failed: oom"
    error = '{"type":"error","code":"x","message":"bad","sequence_number":3}'
    outcome, ended, _ = _feed("responses", [("error", error)])
    assert ended and outcome.error is not None and "bad" in outcome.error
    delta = '{"type":"response.output_text.delta","delta":"a"}'
    outcome, ended, _ = _feed("responses", [("response.output_text.delta", delta)])
    assert not ended and outcome.error is None
    assert ResponsesStream.end_missing == "stream ended before response.completed"


def test_messages_stream_adds_the_cache_to_the_prompt() -> None:
    start_usage = (
        '{"input_tokens":8,"output_tokens":0,"cache_creation_input_tokens":16,'
        '"cache_read_input_tokens":32}'
    )
    events = [
        ("message_start", '{"type":"message_start","message":{"usage":' + start_usage + "}}"),
        ("content_block_start", '{"type":"content_block_start","index":0}'),
        (
            "content_block_delta",
            '{"type":"content_block_delta","delta":{"type":"text_delta","text":"Hi"}}',
        ),
        (
            "content_block_delta",
            '{"type":"content_block_delta","delta":{"type":"input_json_delta","partial_json":"{"}}',
        ),
        ("content_block_stop", '{"type":"content_block_stop","index":0}'),
        # Anthropic's own final usage: output tokens only; the prompt's stands.
        ("message_delta", '{"type":"message_delta","delta":{},"usage":{"output_tokens":5}}'),
        ("message_stop", '{"type":"message_stop"}'),
    ]
    outcome, ended, reply = _feed("messages", events)
    assert ended and outcome.error is None
    assert reply == "Hi"
    assert outcome.ttft_s == 3.0
    assert (outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens) == (56, 32, 5)


def test_messages_stream_failures() -> None:
    error = '{"type":"error","error":{"type":"api_error","message":"boom"}}'
    outcome, ended, _ = _feed("messages", [("error", error)])
    assert ended and outcome.error == "stream error: boom"
    outcome, ended, _ = _feed("messages", [("message_start", '{"type":"message_start"}')])
    assert not ended and outcome.error is None
    assert MessagesStream.end_missing == "stream ended before message_stop"
    outcome, ended, _ = _feed("messages", [("message_start", "{not json")])
    assert ended and outcome.error is not None and outcome.error.startswith("undecodable")


# --- through HTTP: streams that stop early ------------------------------------------------

_TRUNCATED: dict[Api, bytes] = {
    "chat": b'data: {"choices":[{"index":0,"delta":{"content":"ab"}}]}\n\n',
    "responses": b"event: response.output_text.delta\n"
    b'data: {"type":"response.output_text.delta","delta":"ab"}\n\n',
    "messages": b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","delta":{"type":"text_delta","text":"ab"}}\n\n',
}


def _truncated_stream(api: Api) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_TRUNCATED[api])
        await response.write_eof()
        return response

    return handler


@pytest.fixture
async def truncating_server() -> AsyncIterator[str]:
    """A server whose every stream stops after one text event (a worker that died)."""
    app = web.Application()
    for api in APIS:
        app.router.add_post(PATHS[api], _truncated_stream(api))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("api", APIS)
async def test_a_stream_without_its_end_is_an_error(truncating_server: str, api: Api) -> None:
    async with open_http_session(2) as http:
        client = ChatClient(http, truncating_server, "m", api=api)
        outcome = await client.stream_chat(ChatRequest("s", CONVERSATION, 4))
    assert outcome.status == 200
    assert outcome.reply == "ab"
    assert outcome.ttft_s is not None
    assert outcome.error == READERS[api].end_missing


@pytest.fixture
async def capturing_server() -> AsyncIterator[tuple[str, list[tuple[str, str, object]]]]:
    """A server that notes each request's path, session header and body, then ends the
    stream at once."""
    seen: list[tuple[str, str, object]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append((request.path, request.headers["X-Session-Id"], await request.json()))
        return web.Response(status=500, text="noted")

    app = web.Application()
    for api in APIS:
        app.router.add_post(PATHS[api], handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    finally:
        await runner.cleanup()


async def test_each_api_posts_its_body_to_its_path_with_the_session_header(
    capturing_server: tuple[str, list[tuple[str, str, object]]],
) -> None:
    url, seen = capturing_server
    request = ChatRequest("sess-1", CONVERSATION, 4)
    async with open_http_session(2) as http:
        for api in APIS:
            outcome = await ChatClient(http, url, "m", api=api).stream_chat(request)
            assert outcome.error == "HTTP 500: noted"
    assert seen == [
        ("/v1/chat/completions", "sess-1", chat_body("m", request)),
        ("/v1/responses", "sess-1", responses_body("m", request)),
        ("/v1/messages", "sess-1", messages_body("m", request)),
    ]


# --- against the simulated engine ---------------------------------------------------------


def _workload() -> list[Turn]:
    system = (TextBlock("shared-system", 120),)
    turns = []
    for index, session in enumerate(("alpha", "beta")):
        for turn in range(3):
            turns.append(
                Turn(
                    session=session,
                    turn=turn,
                    arrival=index * 1.0,
                    gap=0.0 if turn == 0 else 1.0,
                    user=(TextBlock(f"{session}-user-{turn}", 40 + 7 * turn),),
                    output_tokens=OUTPUT_TOKENS,
                    system=system if turn == 0 else None,
                )
            )
    return turns


async def _replay_on_a_fresh_engine(engine_factory: EngineFactory, api: Api) -> RunResult:
    async with engine_factory(time_scale=TIME_SCALE) as running:
        config = ReplayConfig(
            target=running.url,
            trace=Path("apis.jsonl"),
            concurrency=4,
            time_scale=TIME_SCALE,
            api=api,
        )
        return await replay(config, select_sessions(_workload()))


def _by_turn(result: RunResult) -> dict[tuple[str, int], RequestRecord]:
    return {(r.session, r.turn): r for r in result.records}


async def test_each_api_replays_a_session_onto_the_prefix_cache(
    engine_factory: EngineFactory,
) -> None:
    results = {api: await _replay_on_a_fresh_engine(engine_factory, api) for api in APIS}
    for api, result in results.items():
        assert result.meta.api == api
        assert result.meta.model == TEST_MODEL
        assert len(result.records) == 6
        for record in result.records:
            assert record.error is None, (api, record)
            assert record.status == 200
            assert record.completion_tokens == OUTPUT_TOKENS, api
            assert record.ttft_s is not None and 0 < record.ttft_s <= record.latency_s
            if record.turn > 0:
                assert record.cached_tokens > 0, (api, record)
                # The oracle follows the replies the replay captured: an exact match
                # means each reply's text came back whole.
                assert record.cached_tokens == record.oracle_cached_tokens, (api, record)
    # The engine renders the same prompt whichever API carried the conversation.
    chat = _by_turn(results["chat"])
    for api in ("responses", "messages"):
        other = _by_turn(results[api])
        assert other.keys() == chat.keys()
        for key, record in chat.items():
            assert other[key].prompt_tokens == record.prompt_tokens, (api, key)
            assert other[key].cached_tokens == record.cached_tokens, (api, key)


@pytest.mark.parametrize("api", APIS)
async def test_the_reply_text_is_captured(engine_factory: EngineFactory, api: Api) -> None:
    async with engine_factory(time_scale=TIME_SCALE) as running, open_http_session(2) as http:
        client = ChatClient(http, running.url, TEST_MODEL, api=api)
        outcome = await client.stream_chat(ChatRequest("s", CONVERSATION, 9))
    assert outcome.error is None
    assert outcome.status == 200
    assert outcome.completion_tokens == 9
    assert outcome.reply  # the simulated engine's words for 9 tokens
    assert outcome.prompt_tokens == num_tokens(tokenize_prompt(CONVERSATION))


@pytest.mark.parametrize("api", APIS)
async def test_engine_errors_are_recorded(engine_factory: EngineFactory, api: Api) -> None:
    async with engine_factory(time_scale=TIME_SCALE) as running, open_http_session(2) as http:
        wrong = ChatClient(http, running.url, "no-such-model", api=api)
        outcome = await wrong.stream_chat(ChatRequest("s", CONVERSATION, 4))
        assert outcome.status == 404
        assert outcome.error is not None and outcome.error.startswith("HTTP 404: ")
        assert "no-such-model" in outcome.error

        async with http.post(
            f"{running.url}/sim/faults", json={"fail_requests": True, "fail_status": 503}
        ) as resp:
            assert resp.status == 200
        config = ReplayConfig(
            target=running.url,
            trace=Path("apis.jsonl"),
            model=TEST_MODEL,
            time_scale=TIME_SCALE,
            api=api,
        )
        result = await replay(config, select_sessions(_workload(), max_sessions=1))
    assert [(r.turn, r.status) for r in result.records] == [(0, 503), (1, 503), (2, 503)]
    assert all(r.error is not None and r.error.startswith("HTTP 503") for r in result.records)


async def test_a_bad_request_is_recorded(engine_factory: EngineFactory) -> None:
    """A 400: a prompt longer than the engine's context. (Too many output tokens would
    not do: the Responses API cuts ``max_output_tokens`` to what the context leaves.)"""
    async with engine_factory(time_scale=TIME_SCALE) as running, open_http_session(2) as http:
        too_long = ({"role": "user", "content": "word " * running.engine.max_model_len},)
        for api in APIS:
            client = ChatClient(http, running.url, TEST_MODEL, api=api)
            outcome = await client.stream_chat(ChatRequest("s", too_long, 4))
            assert outcome.status == 400, (api, outcome)
            assert outcome.error is not None and outcome.error.startswith("HTTP 400: ")
