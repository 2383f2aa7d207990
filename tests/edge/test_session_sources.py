"""Where a session key is read: the agents' own headers, the body's fields, the APIs' own
fields, in the configured order; the source named in the request log and ``/metrics``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
import xxhash

from router.apis.request import parse_request
from router.apis.sessions import NO_SESSION, SessionSources
from router.cli.serve import flag_overrides, register
from router.config_loader import load_config
from router.errors import BadRequest, ConfigError
from router.wire.kinds import Kind
from router.wire.sessions import DEFAULT_SESSION_KEYS
from tests.conftest import TEST_MODEL, EngineFactory, RunningRouter, router_config, serve_router
from tests.router_client import engines, metric

BLOCK = 64
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def digest(key: str) -> str:
    return xxhash.xxh3_128_hexdigest(key.encode())


def source_of(
    headers: Mapping[bytes, bytes],
    body: Mapping[str, Any] = CHAT,
    kind: Kind = "chat",
    sources: SessionSources | None = None,
) -> tuple[str | None, str]:
    request = parse_request(kind, orjson.dumps(body), BLOCK, headers, sources or SessionSources())
    return request.session_key, request.session_source


@pytest.mark.parametrize(
    "header",
    [b"x-claude-code-session-id", b"x-session-affinity", b"session_id", b"session-id"],
)
def test_each_agents_own_header_names_its_session(header: bytes) -> None:
    assert source_of({header: b"abc"}) == (digest("abc"), f"header:{header.decode()}")


def test_the_first_source_in_the_order_wins() -> None:
    headers = {
        b"x-correlation-id": b"corr",
        b"session-id": b"codex",
        b"x-claude-code-session-id": b"claude",
    }
    assert source_of(headers) == (digest("claude"), "header:x-claude-code-session-id")
    assert source_of({**headers, b"x-session-id": b"own"}) == (digest("own"), "header:x-session-id")
    # X-Correlation-ID is read only where asked for: gateways stamp one per request.
    with_user = {**CHAT, "user": "alice"}
    assert source_of({b"x-correlation-id": b"corr"}, with_user) == (digest("alice"), "body:user")
    assert source_of({b"x-correlation-id": b"corr"}) == (None, NO_SESSION)
    asked = SessionSources(("header:x-correlation-id", *DEFAULT_SESSION_KEYS))
    assert source_of({b"x-correlation-id": b"corr"}, with_user, sources=asked) == (
        digest("corr"),
        "header:x-correlation-id",
    )
    assert source_of({b"x-session-affinity": b""}) == (None, NO_SESSION)  # empty: none


def test_the_apis_own_fields_are_the_api_source() -> None:
    responses = {"model": "m", "input": "hi", "prompt_cache_key": "codex-conv"}
    messages = {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"user_id": "claude-user"},
    }
    assert source_of({}, responses, "responses") == (digest("codex-conv"), "api")
    assert source_of({}, messages, "messages") == (digest("claude-user"), "api")
    # The agent's header comes before the API's field.
    assert source_of({b"session_id": b"h"}, responses, "responses") == (
        digest("h"),
        "header:session_id",
    )
    too_long = {**responses, "prompt_cache_key": "k" * 2000}
    with pytest.raises(BadRequest) as info:
        source_of({}, too_long, "responses")
    assert info.value.param == "prompt_cache_key"


def test_a_configured_order_is_followed_and_unlisted_sources_are_not_read() -> None:
    sources = SessionSources(("body:conversation", "header:X-Tenant-Session"))
    body = {**CHAT, "user": "alice", "conversation": "c1"}
    assert source_of({b"x-tenant-session": b"t"}, body, sources=sources) == (
        digest("c1"),
        "body:conversation",
    )
    assert source_of({b"x-tenant-session": b"t"}, CHAT, sources=sources)[1] == (
        "header:x-tenant-session"
    )
    assert source_of({b"x-claude-code-session-id": b"x"}, CHAT, sources=sources) == (
        None,
        NO_SESSION,
    )
    assert sources.labels == ("body:conversation", "header:x-tenant-session", NO_SESSION)


@pytest.mark.parametrize(
    ("keys", "problem"),
    [
        (["cookie"], "expected 'header:NAME'"),
        (["header:"], "HTTP token"),
        (["header:x y"], "HTTP token"),
        (["body:"], "name the body field"),
        (["header:X-A", "header:x-a"], "listed twice"),
    ],
)
def test_bad_session_keys_are_named(keys: list[str], problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(flags={"session_keys": keys}, environ={})
    assert any(problem in p and p.startswith("session_keys") for p in info.value.problems)


def test_the_settings_session_keys_replaced_are_still_read() -> None:
    config = load_config(
        flags={"session_header": "X-User", "session_body_fields": ["conv"]}, environ={}
    )
    assert config.session_keys[0] == "header:x-user"
    assert [k for k in config.session_keys if k.startswith("body:")] == ["body:conv"]
    assert set(DEFAULT_SESSION_KEYS) - set(config.session_keys) == {
        "header:x-session-id",
        "body:session_id",
        "body:user",
    }
    with pytest.raises(ConfigError):
        load_config(flags={"session_header": "X", "session_keys": ["api"]}, environ={})


def test_serve_session_header_flags_come_before_every_other_source() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(
        ["serve", "--session-header", "X-Mine", "--session-header", "x-session-affinity"]
    )
    config = load_config(flags=flag_overrides(args), environ={})
    assert config.session_keys[:2] == ("header:x-mine", "header:x-session-affinity")
    assert len(config.session_keys) == len(DEFAULT_SESSION_KEYS) + 1  # no repeat


# -- over HTTP, with the agents' SDKs -----------------------------------------------------


@pytest.fixture
async def router(
    engine_factory: EngineFactory, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[RunningRouter]:
    caplog.set_level(logging.INFO, logger="kvrouter.requests")
    async with (
        engines(engine_factory, 2, responses_store=True) as fleet,
        serve_router(router_config(fleet, log_requests=True)) as running,
    ):
        yield running


async def test_agent_sessions_are_known_by_their_headers(
    router: RunningRouter, caplog: pytest.LogCaptureFixture
) -> None:
    claude = anthropic.AsyncAnthropic(
        base_url=router.url,
        api_key="x",
        max_retries=0,
        default_headers={"x-claude-code-session-id": "claude-1"},
    )
    aiperf = openai.OpenAI(
        base_url=f"{router.url}/v1",
        api_key="x",
        max_retries=0,
        default_headers={"X-Correlation-ID": "conv-7", "X-Session-Affinity": "conv-7"},
    )
    codex = openai.AsyncOpenAI(
        base_url=f"{router.url}/v1",
        api_key="x",
        max_retries=0,
        default_headers={"session_id": "cx"},
    )
    async with claude, codex:
        await claude.messages.create(
            model=TEST_MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )

        def aiperf_turn() -> None:
            aiperf.chat.completions.create(
                model=TEST_MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )

        with aiperf:  # the synchronous client, off the loop the router runs on
            await asyncio.to_thread(aiperf_turn)
        await codex.responses.create(model=TEST_MODEL, max_output_tokens=4, input="hi")
    sessions = router.state.router.learner.sessions
    for key in ("claude-1", "conv-7", "cx"):
        assert sessions.get(digest(key)) is not None, key
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvrouter.requests"]
    assert [line["session_source"] for line in lines] == [
        "header:x-claude-code-session-id",
        "header:x-session-affinity",
        "header:session_id",
    ]
    async with aiohttp.ClientSession() as http:
        counted = {
            source: await metric(http, router, "kvrouter_session_keys_total", source=source)
            for source in (*DEFAULT_SESSION_KEYS, NO_SESSION)
        }
    assert counted == {
        **dict.fromkeys((*DEFAULT_SESSION_KEYS, NO_SESSION), 0.0),
        "header:x-claude-code-session-id": 1.0,
        "header:x-session-affinity": 1.0,
        "header:session_id": 1.0,
    }


def test_a_subagent_names_its_parent_and_may_mark_its_last_request() -> None:
    headers = {b"x-claude-code-session-id": b"child", b"x-dynamo-parent-session-id": b"mom"}
    request = parse_request("chat", orjson.dumps(CHAT), BLOCK, headers, SessionSources())
    assert request.session_key == digest("child") and request.parent_session == digest("mom")
    assert not request.ends_session
    ending = parse_request(
        "chat", orjson.dumps(CHAT), BLOCK, {**headers, b"x-session-end": b"true"}, SessionSources()
    )
    assert ending.ends_session and ending.parent_session == digest("mom")
    # Without a session of its own, a parent or an end names nothing.
    orphan = parse_request(
        "chat", orjson.dumps(CHAT), BLOCK, {b"x-dynamo-parent-session-id": b"mom"}
    )
    assert orphan.session_key is None and orphan.parent_session is None


async def test_the_request_log_names_a_subagents_parent(
    router: RunningRouter, caplog: pytest.LogCaptureFixture
) -> None:
    async def ask(headers: dict[str, str]) -> None:
        async with openai.AsyncOpenAI(
            base_url=f"{router.url}/v1", api_key="x", default_headers=headers
        ) as client:
            await client.chat.completions.create(
                model=TEST_MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )

    await ask({"X-Session-Id": "parent-1"})
    await ask({"X-Session-Id": "child-1", "X-Dynamo-Parent-Session-ID": "parent-1"})
    parent, child = (
        orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvrouter.requests"
    )
    assert parent["parent"] is None and child["parent"] == parent["session"] is not None
    assert router.state.router.learner.worker_of(digest("parent-1")) == parent["worker"]


def test_session_settings_from_the_environment_are_comma_separated() -> None:
    environ = {"KVROUTER_SESSION_BODY_FIELDS": "conv,user", "KVROUTER_SESSION_HEADER": ""}
    keys = load_config(environ=environ).session_keys
    assert [k for k in keys if k.startswith("body:")] == ["body:conv", "body:user"]
    assert "header:x-session-id" not in keys  # an empty header: none in its place
    environ = {"KVROUTER_SESSION_KEYS": "header:x-a,api"}
    flags = {"session_headers": ["x-mine"]}
    assert load_config(flags=flags, environ=environ).session_keys == (
        "header:x-mine",
        "header:x-a",
        "api",
    )


def test_two_client_keys_naming_the_same_session_have_two_sessions() -> None:
    headers = {b"x-session-id": b"1", b"x-dynamo-parent-session-id": b"0"}
    alice, bob, nobody = (
        SessionSources().find(headers, {}, None, 1024, tenant) for tenant in ("a", "b", None)
    )
    assert alice is not None and bob is not None and nobody is not None
    assert len({alice.digest, bob.digest, nobody.digest}) == 3
    assert len({alice.parent, bob.parent, nobody.parent}) == 3
    assert nobody.digest == digest("1")  # without client keys, the key as sent
