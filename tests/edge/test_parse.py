"""The request parser: what a request may carry, and the OpenAI errors for what it may not.

Plain values for the parser itself; real HTTP to a served router (and the OpenAI client)
for the answers clients see.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from router.apis.request import DEFAULT_LIMITS, ClientRequest, parse_request
from router.apis.sessions import SessionSources
from router.config import (
    DEFAULT_MAX_CONTENT_PARTS,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_MAX_SESSION_KEY_BYTES,
    RequestLimits,
    RouterConfig,
)
from router.config_loader import load_config
from router.errors import BadRequest, ConfigError
from router.index.prefix import render_prompt
from tests.conftest import TEST_MODEL, EngineFactory, router_config, serve_router
from tests.router_client import WORKER, chat_body, conversation, engines, metric, post

SOURCES = SessionSources(("header:X-Session-Id", "body:session_id", "body:user"))
BLOCK = 16
USER = [{"role": "user", "content": "hi"}]


def chat(
    header: str | bytes | None = None, limits: RequestLimits = DEFAULT_LIMITS, **body: Any
) -> ClientRequest:
    raw = orjson.dumps({"model": "m", "messages": USER, **body})
    value = header.encode() if isinstance(header, str) else header
    headers = {} if value is None else {b"x-session-id": value}
    return parse_request("chat", raw, BLOCK, headers, SOURCES, limits)


def nest(depth: int, leaf: bytes = b"0") -> bytes:
    """``leaf`` inside ``depth`` JSON arrays, written as text: orjson will not write it."""
    return b"[" * depth + leaf + b"]" * depth


def chat_raw(messages: bytes) -> bytes:
    return b'{"model": "%s", "max_tokens": 1, "messages": %s}' % (TEST_MODEL.encode(), messages)


# -- session keys -------------------------------------------------------------------------


def test_a_session_key_is_kept_as_a_fixed_size_digest() -> None:
    longest = "k" * DEFAULT_MAX_SESSION_KEY_BYTES
    keys = [chat(user=u).session_key for u in ("u1", "u2", longest)]
    assert all(k is not None and len(k) == 32 and set(k) <= set("0123456789abcdef") for k in keys)
    assert len(set(keys)) == 3
    assert chat(user="u1").session_key == chat(header="u1").session_key == keys[0]
    assert chat(user="u1", session_id="s1").session_key == chat(user="s1").session_key
    assert chat().session_key is None


def test_session_keys_longer_than_the_cap_are_refused() -> None:
    limits = RequestLimits(max_session_key_bytes=8)
    assert chat(limits=limits, user="é" * 4).session_key is not None  # 8 bytes
    with pytest.raises(BadRequest) as info:
        chat(limits=limits, user="é" * 5)
    assert info.value.param == "user"
    with pytest.raises(BadRequest) as info:
        chat("h" * 9, limits)
    assert info.value.param is None


def test_a_session_header_that_is_not_utf8_still_has_a_key() -> None:
    key = chat(header=b"a\xffb").session_key
    assert key is not None and key != chat(header=b"a\xfeb").session_key


# -- counts -------------------------------------------------------------------------------


def test_message_and_content_part_counts_are_capped() -> None:
    limits = RequestLimits(max_messages=3, max_content_parts=4)
    part = {"type": "text", "text": "x"}
    chat(limits=limits, messages=USER * 3)
    chat(limits=limits, messages=[{"role": "user", "content": [part] * 2}] * 2)
    for messages in (
        USER * 4,
        [{"role": "user", "content": [part] * 5}],
        [{"role": "user", "content": [part] * 3}] * 2,
    ):
        with pytest.raises(BadRequest) as info:
            chat(limits=limits, messages=messages)
        assert info.value.param == "messages"


def test_the_limits_are_validated_when_the_config_is_built() -> None:
    assert RouterConfig().limits == RequestLimits(
        DEFAULT_MAX_MESSAGES, DEFAULT_MAX_CONTENT_PARTS, DEFAULT_MAX_SESSION_KEY_BYTES
    )
    for name in ("max_messages", "max_content_parts", "max_session_key_bytes"):
        with pytest.raises(ConfigError, match=name):
            RequestLimits(**{name: 0})
    environ = {"KVROUTER_LIMITS__MAX_MESSAGES": "5"}
    assert load_config(environ=environ).limits.max_messages == 5
    with pytest.raises(ConfigError, match=r"limits\.max_session_key_bytes"):
        load_config(environ={"KVROUTER_LIMITS__MAX_SESSION_KEY_BYTES": "0"})


# -- token-id prompts ---------------------------------------------------------------------


def test_the_history_is_what_the_previous_turn_sent() -> None:
    system = {"role": "system", "content": "s" * 100}
    first = [system, {"role": "user", "content": "u" * 50}]
    reply = {"role": "assistant", "content": "a" * 70}
    second = [
        *first,
        reply,
        {"role": "tool", "content": "t" * 40},
        {"role": "user", "content": "q"},
    ]

    def parsed(messages: list[dict[str, str]]) -> ClientRequest:
        raw = orjson.dumps({"model": "m", "messages": messages})
        return parse_request("chat", raw, BLOCK)

    turn1, turn2 = parsed(first), parsed(second)
    # The first turn's history is its system prompt; the second's, the first turn's prompt.
    assert turn1.history_blocks == (1 + 6 + 1 + 100) // BLOCK
    assert turn2.history_blocks == len(turn1.key.hashes)
    assert turn2.key.hashes[: turn2.history_blocks] == turn1.key.hashes
    completion = parse_request(
        "completion", orjson.dumps({"model": "m", "prompt": "p" * 200}), BLOCK
    )
    assert completion.history_blocks == 1


def test_token_ids_render_as_four_little_endian_bytes_each() -> None:
    ids = [0, 1, 258, 2**32 - 1]
    assert render_prompt(ids) == b"\x1d" + b"".join(t.to_bytes(4, "little") for t in ids)
    raw = orjson.dumps({"model": "m", "prompt": ids})
    assert parse_request("completion", raw, 4).key.hashes  # accepted
    for prompt in ([-1], [2**32], [1, True], [1, 2.0], [1, "a"], [[1], [2]]):
        raw = orjson.dumps({"model": "m", "prompt": prompt})
        with pytest.raises(BadRequest) as info:
            parse_request("completion", raw, BLOCK)
        assert info.value.param == "prompt", prompt


# -- over HTTP ----------------------------------------------------------------------------

_PART = b'{"type": "text", "text": "x"}'
_LONG_KEY = "k" * (DEFAULT_MAX_SESSION_KEY_BYTES + 1)
# (name, body, session header, param): each must get a 400 invalid_request_error.
_REFUSED: list[tuple[str, bytes, str | None, str | None]] = [
    (
        "too many messages",
        chat_raw(
            b"["
            + b",".join([b'{"role": "user", "content": ""}'] * (DEFAULT_MAX_MESSAGES + 1))
            + b"]"
        ),
        None,
        "messages",
    ),
    (
        "too many content parts",
        chat_raw(
            b'[{"role": "user", "content": [%s]}]'
            % b",".join([_PART] * (DEFAULT_MAX_CONTENT_PARTS + 1))
        ),
        None,
        "messages",
    ),
    (
        "session key too long",
        orjson.dumps({"model": TEST_MODEL, "messages": USER, "user": _LONG_KEY}),
        None,
        "user",
    ),
    (
        "session header too long",
        orjson.dumps({"model": TEST_MODEL, "messages": USER}),
        _LONG_KEY,
        None,
    ),
    (
        "content part nested 300 deep",
        chat_raw(
            b'[{"role": "user", "content": [{"type": "image_url", "image_url": %s}]}]' % nest(300)
        ),
        None,
        "messages",
    ),
    (
        "text nested 1000 deep",
        chat_raw(b'[{"role": "user", "content": [{"type": "text", "text": %s}]}]' % nest(1000)),
        None,
        "messages",
    ),
    (
        "tool_calls nested 300 deep",
        chat_raw(b'[{"role": "assistant", "content": null, "tool_calls": %s}]' % nest(300)),
        None,
        "messages",
    ),
    (
        "content part not an object",
        chat_raw(b'[{"role": "user", "content": ["x"]}]'),
        None,
        "messages",
    ),
    ("body nested 2000 deep", chat_raw(nest(2000)), None, None),
]


async def test_requests_over_a_limit_or_malformed_get_openai_errors(
    engine_factory: EngineFactory,
) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet)) as router,
        aiohttp.ClientSession() as http,
    ):
        for name, raw, header, param in _REFUSED:
            headers = {"Content-Type": "application/json"}
            if header is not None:
                headers["X-Session-Id"] = header
            async with http.post(
                router.url + "/v1/chat/completions", data=raw, headers=headers
            ) as response:
                assert response.status == 400, (name, await response.text())
                assert response.content_type == "application/json", name
                assert WORKER not in response.headers, name  # refused before any worker
                error = (await response.json())["error"]
            assert error["type"] == "invalid_request_error", name
            assert error["code"] == 400 and error["param"] == param, name
            assert isinstance(error["message"], str) and error["message"], name
        assert await metric(http, router, "kvrouter_rejected_requests_total", status="400") == len(
            _REFUSED
        )
        result = await post(http, router.url, chat_body(conversation("after", 20, 5)))
        assert result.status == 200


async def test_the_openai_client_sees_the_message_cap_as_a_bad_request(
    engine_factory: EngineFactory,
) -> None:
    async with engines(engine_factory, 1) as fleet, serve_router(router_config(fleet)) as router:
        client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        try:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(
                    model=TEST_MODEL,
                    messages=[{"role": "user", "content": ""}] * (DEFAULT_MAX_MESSAGES + 1),
                )
        finally:
            await client.close()
    assert info.value.status_code == 400 and WORKER not in info.value.response.headers
    assert info.value.type == "invalid_request_error" and info.value.param == "messages"


async def test_the_router_remembers_sessions_by_digest(engine_factory: EngineFactory) -> None:
    longest = "k" * DEFAULT_MAX_SESSION_KEY_BYTES
    body = chat_body(conversation("digest", 20, 5), stream=False, user=longest)
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet)) as router,
        aiohttp.ClientSession() as http,
    ):
        assert (await post(http, router.url, body)).status == 200
        key = parse_request(
            "chat",
            orjson.dumps(body),
            router.config.prefix.key_block_bytes,
        ).session_key
        assert key is not None and len(key) == 32
        assert router.state.router.learner.sessions.get(key) is not None


async def test_a_session_header_that_is_not_utf8_is_routed(engine_factory: EngineFactory) -> None:
    body = orjson.dumps(chat_body(conversation("bytes", 20, 5), stream=False))
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, policy="session", log_requests=True)) as router,
    ):
        host, port = router.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nX-Session-Id: a\xffb\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        response = await reader.read()
        writer.close()
        await writer.wait_closed()
    assert response.startswith(b"HTTP/1.1 200"), response[:200]


async def test_configured_limits_reach_the_parser(engine_factory: EngineFactory) -> None:
    config_limits = RequestLimits(max_messages=2)
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, limits=config_limits)) as router,
        aiohttp.ClientSession() as http,
    ):
        result = await post(http, router.url, chat_body(USER * 3, stream=False))
    assert result.status == 400 and WORKER not in result.headers
