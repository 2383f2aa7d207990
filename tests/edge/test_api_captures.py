"""The Responses and Messages replies as the router reads them: the reply, text and tool
calls, extends the chain exactly as the next turn's request carries it; usage is read
from each API's own fields; stored responses are remembered within a bound."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.apis.anthropic_reply import MessagesCapture
from router.apis.capture import ChatCapture, ReplyCapture
from router.apis.request import ClientRequest, parse_request
from router.apis.responses_reply import ResponsesCapture
from router.errors import BadRequest
from router.fleet.workers import Fleet, Worker
from router.index.prefix import CHAT_REPLY_HEADER, ChainExtender
from router.routing.response_owners import Owner, ResponseOwners
from router.wire.kinds import Kind

BLOCK_BYTES = 64
SYSTEM = "You are a coding agent. " * 20
ASK = "Read a.py and tell me what it does. " * 5
TOOL_INPUT = {"path": "a.py", "lines": [1, 80], "note": "café"}


def keyed(kind: Kind, body: dict[str, Any]) -> ClientRequest:
    return parse_request(kind, orjson.dumps(body), BLOCK_BYTES)


def sse(*events: dict[str, Any]) -> bytes:
    return b"".join(
        b"event: %s\ndata: %s\n\n" % (str(e.get("type")).encode(), orjson.dumps(e)) for e in events
    )


def capture_for(request: ClientRequest, kind: type[ReplyCapture]) -> ReplyCapture:
    return kind(ChainExtender(request.key, BLOCK_BYTES, CHAT_REPLY_HEADER))


def assert_extends(first: ClientRequest, reply: list[int], second: ClientRequest) -> None:
    """The second turn's chain begins with the first turn's prompt and its reply."""
    chain = (*first.key.hashes, *reply)
    assert reply, "the reply added no block"
    assert second.key.hashes[: len(chain)] == chain


# -- Anthropic Messages -----------------------------------------------------------------

FIRST_MESSAGES = [{"role": "user", "content": ASK}]
MESSAGES_TURN = {
    "model": "m",
    "max_tokens": 100,
    "system": [{"type": "text", "text": SYSTEM}],
    "messages": FIRST_MESSAGES,
}
REPLY_TEXT = "Let me open the file first, then I will summarise what it does for you. " * 3


def messages_next_turn() -> dict[str, Any]:
    assistant = {
        "role": "assistant",
        "content": [
            {"type": "text", "text": REPLY_TEXT},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": TOOL_INPUT},
        ],
    }
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "print(1)"}],
    }
    return {**MESSAGES_TURN, "messages": [*FIRST_MESSAGES, assistant, result]}


def messages_stream() -> bytes:
    arguments = orjson.dumps(TOOL_INPUT).decode()  # the engine's own spacing
    usage = {"input_tokens": 7, "cache_read_input_tokens": 32, "cache_creation_input_tokens": 16}
    return sse(
        {"type": "message_start", "message": {"id": "m1", "usage": {**usage, "output_tokens": 0}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        *(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}}
            for t in (REPLY_TEXT[:10], REPLY_TEXT[10:])
        ),
        {"type": "content_block_stop", "index": 0},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "read_file",
                "input": {},
            },
        },
        *(
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": part},
            }
            for part in (arguments[:7], arguments[7:])
        ),
        {"type": "content_block_stop", "index": 1},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use"},
            "usage": {**usage, "output_tokens": 30},
        },
        {"type": "message_stop"},
    )


def test_a_streamed_message_with_a_tool_call_extends_the_chain_as_the_next_turn_sends_it() -> None:
    first = keyed("messages", MESSAGES_TURN)
    capture = capture_for(first, MessagesCapture)
    stream = messages_stream()
    for i in range(0, len(stream), 13):  # cut anywhere
        capture.feed_stream(stream[i : i + 13])
    assert_extends(first, capture.reply_hashes(), keyed("messages", messages_next_turn()))
    assert (capture.prompt_tokens, capture.cached_tokens, capture.completion_tokens) == (55, 32, 30)
    assert capture.turn_end == "tool"  # the session waits on the tool


def test_a_whole_message_extends_the_chain_alike() -> None:
    first = keyed("messages", MESSAGES_TURN)
    capture = capture_for(first, MessagesCapture)
    capture.feed_whole(
        orjson.dumps(
            {
                "type": "message",
                "content": messages_next_turn()["messages"][1]["content"],
                "usage": {"input_tokens": 40, "output_tokens": 30},
            }
        )
    )
    assert_extends(first, capture.reply_hashes(), keyed("messages", messages_next_turn()))
    assert capture.turn_end == "tool"
    # Without cache_read_input_tokens (vLLM without prompt-token details) the hit is unknown.
    assert (capture.prompt_tokens, capture.cached_tokens) == (40, None)


def test_an_error_event_leaves_the_chain_alone() -> None:
    capture = capture_for(keyed("messages", MESSAGES_TURN), MessagesCapture)
    capture.feed_stream(
        sse(
            {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "x" * 200}},
            {"type": "error", "error": {"type": "api_error", "message": "boom"}},
        )
    )
    assert capture.errored and capture.reply_hashes() == []


# -- OpenAI Responses -------------------------------------------------------------------

RESPONSES_TURN = {"model": "m", "instructions": SYSTEM, "input": [{"role": "user", "content": ASK}]}
CALL = {"type": "function_call", "call_id": "call_1", "name": "read_file"}
ARGUMENTS = orjson.dumps(TOOL_INPUT).decode()


def responses_next_turn() -> dict[str, Any]:
    message = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": REPLY_TEXT}],
    }
    call = {**CALL, "arguments": ARGUMENTS}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "print(1)"}
    return {**RESPONSES_TURN, "input": [*RESPONSES_TURN["input"], message, call, result]}


def test_a_streamed_response_with_a_function_call_extends_the_chain() -> None:
    first = keyed("responses", RESPONSES_TURN)
    capture = capture_for(first, ResponsesCapture)
    usage = {"input_tokens": 60, "input_tokens_details": {"cached_tokens": 48}, "output_tokens": 9}
    capture.feed_stream(
        sse(
            {"type": "response.created", "response": {"id": "resp_abc", "usage": None}},
            {"type": "response.output_item.added", "item": {"type": "message"}},
            *(
                {"type": "response.output_text.delta", "content_index": 0, "delta": t}
                for t in (REPLY_TEXT[:5], REPLY_TEXT[5:])
            ),
            {"type": "response.output_item.done", "item": {**CALL, "arguments": ARGUMENTS}},
            {"type": "response.completed", "response": {"id": "resp_abc", "usage": usage}},
        )
    )
    assert capture.response_id == "resp_abc"
    assert_extends(first, capture.reply_hashes(), keyed("responses", responses_next_turn()))
    assert (capture.prompt_tokens, capture.cached_tokens, capture.completion_tokens) == (60, 48, 9)
    assert capture.turn_end == "tool"  # the session waits on the tool


def test_a_whole_response_extends_the_chain_alike() -> None:
    first = keyed("responses", RESPONSES_TURN)
    capture = capture_for(first, ResponsesCapture)
    output = responses_next_turn()["input"][1:3]
    capture.feed_whole(
        orjson.dumps({"id": "resp_x", "object": "response", "error": None, "output": output})
    )
    assert capture.response_id == "resp_x" and not capture.errored
    assert_extends(first, capture.reply_hashes(), keyed("responses", responses_next_turn()))
    assert capture.turn_end == "tool"  # the session waits on the tool


def test_a_continued_response_claims_no_blocks() -> None:
    """Its prompt begins with a conversation only the worker that stored it has."""
    request = keyed("responses", {**RESPONSES_TURN, "previous_response_id": "resp_abc"})
    assert request.continues == "resp_abc"
    assert request.key.hashes == () and not request.record_reply
    assert request.key.total_bytes > len(ASK)


def test_sessions_come_from_each_apis_own_field() -> None:
    claude = keyed("messages", {**MESSAGES_TURN, "metadata": {"user_id": "session_1"}})
    codex = keyed("responses", {**RESPONSES_TURN, "prompt_cache_key": "session_1"})
    assert claude.session_key == codex.session_key is not None
    assert keyed("messages", MESSAGES_TURN).session_key is None


# -- stored responses -------------------------------------------------------------------


def test_stored_responses_are_remembered_within_a_bound_and_lost_with_their_engine() -> None:
    fleet = Fleet()
    worker = Worker("w0", "http://127.0.0.1:1", 1000, engine_started_at=100.0)
    fleet.add(worker)
    owners = ResponseOwners(max_entries=2)
    for i in range(3):
        owners.remember(f"resp_{i}", Owner.of(worker))
    assert owners.get("resp_0") is None and len(owners) == 2
    owner = owners.get("resp_2")
    assert owner is not None and owner.holder(fleet) is worker
    assert Owner.decode(owner.encode()) == owner
    worker.engine_started_at = 200.0  # restarted: what it stored is gone
    assert owner.holder(fleet) is None
    fleet.remove("w0")
    assert Owner("w0", None).holder(fleet) is None


# -- what clients and engines may send --------------------------------------------------


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


BAD_BODIES = [
    ("messages", b'{"model": "m", "max_tokens": 5, "messages": "hi"}'),
    ("messages", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'),
    ("messages", b'{"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": 5}]}'),
    (
        "messages",
        b'{"model": "m", "max_tokens": 5, "messages": [{"role": "assistant", "content": '
        b'[{"type": "tool_use", "id": "x", "name": "n", "input": {"a": '
        + nested(1000).encode()
        + b"}}]}]}",
    ),
    ("messages", b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": 5}]}'),
    ("responses", b'{"model": "m"}'),
    ("responses", b'{"input": "hi"}'),
    ("responses", b'{"model": "m", "input": [{"role": ["x"], "content": "hi"}]}'),
    ("responses", b'{"model": "m", "input": [{"type": "web_search_call"}]}'),
    ("responses", b'{"model": "m", "input": [{"type": "function_call_output", "output": 5}]}'),
    ("responses", b'{"model": "m", "input": "hi", "previous_response_id": 5}'),
]


@pytest.mark.parametrize(
    ("kind", "raw"), BAD_BODIES, ids=[f"{kind}-{i}" for i, (kind, _) in enumerate(BAD_BODIES)]
)
def test_a_body_the_engine_would_refuse_is_a_400(kind: Kind, raw: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_request(kind, raw, BLOCK_BYTES)


def test_a_tool_input_nested_too_deep_to_rebuild_stops_the_capture_not_the_stream() -> None:
    capture = capture_for(keyed("messages", MESSAGES_TURN), MessagesCapture)
    block = b'{"type": "tool_use", "id": "t", "name": "n", "input": {"a": %s}}' % (
        nested(1000).encode()
    )
    capture.feed_whole(b'{"type": "message", "content": [%s]}' % block)
    assert capture.broken and capture.reply_hashes() == []


def test_an_sglang_error_chunk_leaves_a_chat_chain_alone() -> None:
    """SGLang's in-stream error is ``{"object": "error", …}``, without an ``error`` key:
    the router's capture and the replay's reader read it alike (router.wire.streams)."""
    request = keyed("chat", {"model": "m", "messages": FIRST_MESSAGES})
    capture = capture_for(request, ChatCapture)
    capture.feed_stream(
        b'data: {"choices": [{"delta": {"content": "' + b"x" * 100 + b'"}}]}\n\n'
        b'data: {"object": "error", "message": "boom", "code": 500}\n\n'
    )
    assert capture.errored and capture.reply_hashes() == []


# -- Chat Completions with tool calls ---------------------------------------------------

CHAT_CALL = {"id": "chatcmpl-tool-1", "type": "function"}


def chat_next_turn(content: str | None) -> dict[str, Any]:
    call = {**CHAT_CALL, "function": {"name": "read_file", "arguments": ARGUMENTS}}
    return {
        "model": "m",
        "messages": [
            *FIRST_MESSAGES,
            {"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "print(1)"},
        ],
    }


def test_a_streamed_chat_reply_with_tool_calls_extends_the_chain_as_the_next_turn_sends_it() -> (
    None
):
    first = keyed("chat", {"model": "m", "messages": FIRST_MESSAGES})
    capture = capture_for(first, ChatCapture)
    head = {"index": 0, **CHAT_CALL, "function": {"name": "read_file", "arguments": ""}}
    deltas = [
        {"content": REPLY_TEXT},
        {"tool_calls": [head]},
        *(
            {"tool_calls": [{"index": 0, "function": {"arguments": part}}]}
            for part in (ARGUMENTS[:9], ARGUMENTS[9:])
        ),
    ]
    capture.feed_stream(
        b"".join(b"data: %s\n\n" % orjson.dumps({"choices": [{"delta": d}]}) for d in deltas)
        + b"data: [DONE]\n\n"
    )
    assert_extends(first, capture.reply_hashes(), keyed("chat", chat_next_turn(REPLY_TEXT)))
    assert capture.turn_end == "tool"  # the session waits on the tool


def test_a_whole_chat_reply_of_tool_calls_alone_extends_the_chain() -> None:
    first = keyed("chat", {"model": "m", "messages": FIRST_MESSAGES})
    capture = capture_for(first, ChatCapture)
    call = {**CHAT_CALL, "function": {"name": "read_file", "arguments": ARGUMENTS}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    capture.feed_whole(orjson.dumps({"choices": [{"message": message}]}))
    assert_extends(first, capture.reply_hashes(), keyed("chat", chat_next_turn(None)))
    assert capture.turn_end == "tool"  # the session waits on the tool


def test_a_reply_without_a_tool_call_leaves_its_session_waiting_on_a_person() -> None:
    chat = capture_for(keyed("chat", {"model": "m", "messages": FIRST_MESSAGES}), ChatCapture)
    chat.feed_stream(
        b"data: %s\n\ndata: [DONE]\n\n"
        % orjson.dumps({"choices": [{"delta": {"content": REPLY_TEXT}}]})
    )
    messages = capture_for(keyed("messages", MESSAGES_TURN), MessagesCapture)
    messages.feed_whole(
        orjson.dumps({"type": "message", "content": [{"type": "text", "text": REPLY_TEXT}]})
    )
    responses = capture_for(keyed("responses", RESPONSES_TURN), ResponsesCapture)
    text = {"type": "output_text", "text": REPLY_TEXT}
    item = {"type": "message", "role": "assistant", "content": [text]}
    responses.feed_whole(orjson.dumps({"id": "r", "object": "response", "output": [item]}))
    assert [c.turn_end for c in (chat, messages, responses)] == ["user"] * 3
