"""Hostile input, generated: the parser's contract, and the served router's answers.

The short version of ``kvrouter bench fuzz`` (which sends 10^5 requests to a router
process and watches its memory): a few hundred examples per property, derandomized, so
every run draws the same requests. Strategies are in ``bench/fuzz/inputs.py``; what each
failure found has a regression test in tests/edge/test_hostile_input.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.fuzz.client import Answer, RawRequest, describe, normal_chat, send, violation
from bench.fuzz.inputs import (
    Target,
    admin_requests,
    bodies,
    chat_bodies,
    chat_requests,
    completion_bodies,
    completion_requests,
    messages_bodies,
    messages_requests,
    responses_bodies,
    responses_requests,
    wild_requests,
)
from router.apis.request import parse_request
from router.apis.sessions import SessionSources
from router.config import RequestLimits
from router.errors import RouterError
from router.wire.kinds import Kind
from tests.conftest import TEST_MODEL, EngineFactory, RunningRouter, router_config, serve_router

TARGET = Target(api_key="fuzz-key", admin_token="fuzz-admin", model=TEST_MODEL)
# Small limits, so that examples cross them without megabytes of input.
LIMITS = RequestLimits(max_messages=50, max_content_parts=50, max_session_key_bytes=64)
MAX_BODY_BYTES = 256 * 1024
T = TypeVar("T")


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
            HealthCheck.filter_too_much,
        ],
    )


def check_all(examples: int, strategy: st.SearchStrategy[T], check: Callable[[T], None]) -> None:
    """``check`` on ``examples`` draws of ``strategy``, the failing one shrunk and raised.

    Run as a plain call rather than a collected ``@given`` test: on a failure, the
    Hypothesis pytest plugin imports libcst to suggest a patch, and libcst's import warns
    (a DeprecationWarning, an error here), which would hide the failing example."""
    fuzz_settings(examples)(given(strategy)(check))()


# -- the parser, called directly -----------------------------------------------------------

# Session header values as the wire hands them over: any bytes, and any text encoded
# (lone surrogates too): the parser's contract is on any bytes.
_SESSION_HEADERS = st.one_of(
    st.none(),
    st.binary(max_size=80),
    st.text(st.characters(exclude_categories=()), max_size=20).map(
        lambda t: t.encode("utf-8", "surrogatepass")
    ),
)
_KINDS: list[tuple[Kind, st.SearchStrategy[bytes]]] = [
    ("chat", bodies(chat_bodies(TEST_MODEL))),
    ("completion", bodies(completion_bodies(TEST_MODEL))),
    ("messages", bodies(messages_bodies(TEST_MODEL))),
    ("responses", bodies(responses_bodies(TEST_MODEL))),
]


_CASES = st.tuples(
    st.sampled_from(_KINDS).flatmap(lambda kb: st.tuples(st.just(kb[0]), kb[1])),
    _SESSION_HEADERS,
    st.sampled_from([16, 256, 65536]),
)


def _parse_or_refuse(case: tuple[tuple[Kind, bytes], bytes | None, int]) -> None:
    (kind, raw), header, block_bytes = case
    headers = {} if header is None else {b"x-claude-code-session-id": header}
    if header is not None:  # the same bytes as a parent and as the end mark
        headers |= {b"x-dynamo-parent-session-id": header, b"x-session-end": header}
    try:
        request = parse_request(kind, raw, block_bytes, headers, SessionSources(), LIMITS)
    except RouterError as exc:
        assert 400 <= exc.status < 500, exc
        assert exc.message
        orjson.dumps(exc.body())  # the error middleware can write it
    else:
        assert request.body == raw and request.model
        assert request.session_key is None or len(request.session_key) == 32


def test_the_parser_refuses_bad_input_only_with_a_4xx_router_error() -> None:
    check_all(400, _CASES, _parse_or_refuse)


# -- the served router, over real HTTP -----------------------------------------------------


@pytest.fixture
async def router(engine_factory: EngineFactory) -> AsyncIterator[RunningRouter]:
    """API keys and the admin API on; a fast engine whose context ends early, so that
    examples that reach it are answered at once."""
    async with (
        engine_factory(time_scale=1000.0, max_model_len=4096) as engine,
        serve_router(
            router_config(
                [engine],
                api_keys=(TARGET.api_key,),
                admin_token=TARGET.admin_token,
                max_body_bytes=MAX_BODY_BYTES,
                limits=LIMITS,
            )
        ) as running,
    ):
        yield running


def _port(router: RunningRouter) -> int:
    return int(router.url.rsplit(":", 1)[1])


def _checked(port: int) -> Callable[[RawRequest], None]:
    def check(request: RawRequest) -> None:
        answer = send("127.0.0.1", port, request, timeout_s=30.0)
        assert violation(request, answer) is None, (answer, describe(request))

    return check


async def _fuzz(router: RunningRouter, strategy: st.SearchStrategy[RawRequest], n: int) -> None:
    """``n`` requests from ``strategy`` (a blocking client in a worker thread while this
    loop serves the router); then a normal request must still be served."""
    await asyncio.to_thread(check_all, n, strategy, _checked(_port(router)))
    after: Answer = await asyncio.to_thread(
        send, "127.0.0.1", _port(router), normal_chat(TARGET.api_key, TEST_MODEL), 30.0
    )
    assert after.status == 200, after


async def test_generated_bodies_never_get_a_500_or_an_error_that_is_not_json(
    router: RunningRouter,
) -> None:
    await _fuzz(router, st.one_of(chat_requests(TARGET), completion_requests(TARGET)), 300)


async def test_generated_responses_and_messages_never_get_a_500_or_an_error_that_is_not_json(
    router: RunningRouter,
) -> None:
    await _fuzz(router, st.one_of(messages_requests(TARGET), responses_requests(TARGET)), 300)


async def test_generated_headers_never_get_a_500_or_an_error_that_is_not_json(
    router: RunningRouter,
) -> None:
    await _fuzz(router, chat_requests(TARGET, hostile_headers=True), 200)


async def test_generated_admin_calls_never_get_a_500_or_an_error_that_is_not_json(
    router: RunningRouter,
) -> None:
    strategy = st.one_of(admin_requests(TARGET), admin_requests(TARGET, hostile_headers=True))
    await _fuzz(router, strategy, 200)


async def test_generated_methods_and_targets_never_get_a_500_or_an_error_that_is_not_json(
    router: RunningRouter,
) -> None:
    await _fuzz(router, wild_requests(TARGET), 200)
