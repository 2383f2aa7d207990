"""Regression tests for what the fuzz (tests/edge/test_fuzz.py, ``kvrouter bench fuzz``) found,
each written from the failing example: raw bytes over real HTTP to a served router."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import aiohttp
import orjson
import pytest

from bench.fuzz.client import Answer, RawRequest, send
from policies.base import Decision, RouteRequest, WorkerView
from policies.round_robin import RoundRobinPolicy
from router.edge.decoding import DECODED_CODINGS
from router.routing.policy_slot import ActivePolicy
from tests.conftest import TEST_MODEL, EngineFactory, RunningRouter, router_config, serve_router
from tests.router_client import assert_idle, chat_body, conversation, engines, metric, post

API_KEY = "key-1"
ADMIN_TOKEN = "admin-1"
JSON = (b"Content-Type", b"application/json")
CLIENT = (b"Authorization", b"Bearer " + API_KEY.encode())
ADMIN = (b"Authorization", b"Bearer " + ADMIN_TOKEN.encode())
CHAT = orjson.dumps(
    {"model": TEST_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
)


@contextlib.asynccontextmanager
async def guarded_router(factory: EngineFactory) -> AsyncIterator[RunningRouter]:
    """A router with client API keys and the admin API on."""
    async with (
        engines(factory, 1) as fleet,
        serve_router(router_config(fleet, api_keys=(API_KEY,), admin_token=ADMIN_TOKEN)) as router,
    ):
        yield router


async def raw(router: RunningRouter, request: RawRequest) -> Answer:
    port = int(router.url.rsplit(":", 1)[1])
    return await asyncio.to_thread(send, "127.0.0.1", port, request, 10.0)


def error_of(answer: Answer) -> dict[str, object]:
    assert answer.content_type.startswith("application/json"), answer
    error: dict[str, object] = orjson.loads(answer.body)["error"]
    return error


@pytest.mark.parametrize(
    "value",
    [b"Bearer \xff\xfe", b"Bearer key-1\xb8", b"\xc3(", b"Bearer " + "ké".encode("latin-1")],
)
async def test_an_api_key_that_is_not_utf8_is_refused_with_a_401(
    engine_factory: EngineFactory, value: bytes
) -> None:
    # Found: the API-key check encoded the header as UTF-8, so aiohttp's surrogate escapes
    # for bytes that are not UTF-8 raised UnicodeEncodeError: a 500.
    async with guarded_router(engine_factory) as router:
        for method, path in ((b"GET", b"/v1/models"), (b"POST", b"/v1/chat/completions")):
            answer = await raw(
                router, RawRequest(method, path, (JSON, (b"Authorization", value)), CHAT)
            )
            assert answer.status == 401, answer
            assert error_of(answer)["code"] == "invalid_api_key"
        ok = await raw(router, RawRequest(b"POST", b"/v1/chat/completions", (JSON, CLIENT), CHAT))
        assert ok.status == 200, ok


async def test_an_api_key_sent_in_latin1_matches_only_its_own_bytes(
    engine_factory: EngineFactory,
) -> None:
    # The key is compared as the bytes sent: "é" in latin-1 is not "é" in UTF-8.
    key = "clé"
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, api_keys=(key,))) as router,
    ):
        utf8 = await raw(
            router, RawRequest(b"GET", b"/v1/models", ((b"Authorization", b"Bearer cl\xc3\xa9"),))
        )
        latin1 = await raw(
            router, RawRequest(b"GET", b"/v1/models", ((b"Authorization", b"Bearer cl\xe9"),))
        )
    assert (utf8.status, latin1.status) == (200, 401)


@pytest.mark.parametrize("value", [b"Bearer \xff", b"Bearer admin-1\xb8\x84", b"\x80"])
async def test_an_admin_token_that_is_not_utf8_is_refused_with_a_401(
    engine_factory: EngineFactory, value: bytes
) -> None:
    # Found: GET /admin/policy with "Authorization: Bearer fuzz-adminmt\xb8\x84" was a 500
    # (the admin check encoded the header as UTF-8, as the API-key check did).
    async with guarded_router(engine_factory) as router:
        for method, path in ((b"GET", b"/admin/policy"), (b"POST", b"/admin/workers/x/drain")):
            answer = await raw(router, RawRequest(method, path, ((b"Authorization", value),)))
            assert answer.status == 401, answer
            assert error_of(answer)["type"] == "authentication_error"
        ok = await raw(router, RawRequest(b"GET", b"/admin/policy", (ADMIN,)))
        assert ok.status == 200, ok


@pytest.mark.parametrize("encoding", [b"gzip", b"deflate"])
async def test_a_body_that_is_not_in_its_content_encoding_is_a_400(
    engine_factory: EngineFactory, encoding: bytes
) -> None:
    # Found: "Content-Encoding: gzip" on a body that is not gzip made aiohttp's read()
    # raise RequestPayloadError: a 500 on /v1 and /admin alike.
    encoded = (b"Content-Encoding", encoding)
    async with guarded_router(engine_factory) as router:
        for path, auth in ((b"/v1/chat/completions", CLIENT), (b"/admin/workers", ADMIN)):
            answer = await raw(router, RawRequest(b"POST", path, (JSON, auth, encoded), CHAT))
            assert answer.status == 400, (path, answer)
            error = error_of(answer)
            assert error["type"] == "invalid_request_error"
            assert "Content-Encoding" in str(error["message"]), error


@pytest.mark.parametrize(
    # br and zstd are decoded where their packages are installed: then they are no case.
    "encoding",
    [c for c in (b"x-unknown", b"gzip, gzip", b"br", b"zstd") if c not in DECODED_CODINGS],
)
async def test_a_content_encoding_the_router_cannot_decode_is_a_415(
    engine_factory: EngineFactory, encoding: bytes
) -> None:
    # Found: aiohttp took a body whose Content-Encoding it does not decode as it was
    # (an unknown coding, a list of codings, br or zstd without their packages).
    encoded = (b"Content-Encoding", encoding)
    async with guarded_router(engine_factory) as router:
        for path, auth in ((b"/v1/chat/completions", CLIENT), (b"/admin/workers", ADMIN)):
            answer = await raw(router, RawRequest(b"POST", path, (JSON, auth, encoded), CHAT))
            assert answer.status == 415, (path, answer)
            assert "Content-Encoding" in str(error_of(answer)["message"])


@pytest.mark.parametrize("path", [b"/v1/chat/completions", b"/health", b"/admin/policy"])
async def test_an_unknown_expectation_is_refused_as_json(
    engine_factory: EngineFactory, path: bytes
) -> None:
    # Found: "Expect: m\t" got aiohttp's plain-text 417 ("Unknown Expect"): its expect
    # handler runs before the middlewares.
    async with guarded_router(engine_factory) as router:
        answer = await raw(
            router, RawRequest(b"POST", path, (JSON, CLIENT, (b"Expect", b"m\t")), CHAT)
        )
        assert answer.status == 417, answer
        assert error_of(answer)["type"] == "invalid_request_error"
        continued = await raw(
            router,
            RawRequest(
                b"POST", b"/v1/chat/completions", (JSON, CLIENT, (b"Expect", b"100-continue")), CHAT
            ),
        )
        assert continued.status == 200, continued


_BAD_WORKERS = [
    {"url": "http://127.0.0.1:9", "name": {"a": 1}},  # found: a 500 (unhashable name)
    {"url": "http://127.0.0.1:9", "name": [[-97997582], "#\x00k", []]},  # found: a 500
    {"url": 5},  # was a 500 (urlsplit of an int)
    {"url": ["http://127.0.0.1:9"]},
    {"url": "http://[::1"},  # was a 500 (urlsplit's ValueError)
    {"url": "http://127.0.0.1:99999"},  # was a 201: a worker no request can reach
    {"url": "http://127.0.0.1:9", "kv_tokens": True},  # was a 201 with 1 token
    {"url": "http://127.0.0.1:9", "kv_tokens": "many"},
    {"name": "no-url"},
]


async def test_admin_refuses_a_worker_with_fields_of_the_wrong_type(
    engine_factory: EngineFactory,
) -> None:
    async with guarded_router(engine_factory) as router:
        for body in _BAD_WORKERS:
            answer = await raw(
                router, RawRequest(b"POST", b"/admin/workers", (JSON, ADMIN), orjson.dumps(body))
            )
            assert answer.status == 400, (body, answer)
            assert error_of(answer)["type"] == "invalid_request_error"
        listed = await raw(router, RawRequest(b"GET", b"/admin/workers", (ADMIN,)))
        assert [w["name"] for w in orjson.loads(listed.body)["workers"]] == ["w0"]
        # Found: a name of 5 was kept as the int 5, and every /metrics after it was a 500.
        # As in a config file, it is the string "5".
        numbered = {"url": "http://127.0.0.1:9", "name": 5, "kv_tokens": 1000}
        added = await raw(
            router, RawRequest(b"POST", b"/admin/workers", (JSON, ADMIN), orjson.dumps(numbered))
        )
        assert added.status == 201, added
        assert orjson.loads(added.body)["name"] == "5"
        assert (await raw(router, RawRequest(b"GET", b"/metrics", ()))).status == 200


async def test_a_method_the_path_does_not_have_is_a_json_405_that_names_those_it_has(
    engine_factory: EngineFactory,
) -> None:
    async with guarded_router(engine_factory) as router:
        answer = await raw(router, RawRequest(b"POST", b"/health", ()))
        port = int(router.url.rsplit(":", 1)[1])
        head = await asyncio.to_thread(_head, port, b"DELETE /v1/chat/completions", CLIENT)
    assert answer.status == 405 and error_of(answer)["code"] == 405
    assert b"HTTP/1.1 405" in head and b"Allow: POST\r\n" in head


def _head(port: int, request_line: bytes, header: tuple[bytes, bytes]) -> bytes:
    """The head of the answer (``send`` keeps only its status, type and body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"%s HTTP/1.1\r\nHost: x\r\n%s: %s\r\nConnection: close\r\n\r\n"
            % (request_line, *header)
        )
        return sock.makefile("rb").read().split(b"\r\n\r\n")[0] + b"\r\n"


async def test_requests_that_are_not_http_do_not_fill_the_log(
    engine_factory: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    async with engines(engine_factory, 1) as fleet, serve_router(router_config(fleet)) as router:
        host, port = router.url.removeprefix("http://").split(":")
        for _ in range(3):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /\x00bad HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            assert (await reader.read(64)).startswith(b"HTTP/1.1 400")
            writer.close()
            await writer.wait_closed()
        async with aiohttp.ClientSession() as http, http.get(router.url + "/health") as response:
            assert response.status == 200
    noisy = [r for r in caplog.records if r.levelno >= 30]
    assert noisy == []  # the router answered 400 itself: nothing failed here


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /\x00bad HTTP/1.1\r\nHost: x\r\n\r\n",  # a control byte in the target
        b"POST /v1/chat/completions HTTP/1.1\r\nNo colon here\r\n\r\n",
        b"GET /health HTTP/1.1\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n",  # > 8190
        b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 TLS hello\r\n\r\n",
    ],
)
async def test_http_aiohttp_cannot_parse_is_refused_as_openai_json(
    engine_factory: EngineFactory, request_bytes: bytes
) -> None:
    # Found: aiohttp's own refusals were plain text ("400, message: ..."), unlike every
    # other answer of the router.
    async with engines(engine_factory, 1) as fleet, serve_router(router_config(fleet)) as router:
        host, port = router.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(request_bytes)
        await writer.drain()
        answer = await reader.read()  # the router closes the connection after refusing
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.split(b"\r\n")[0].split(b" ")[1] == b"400", answer[:200]
        assert b"content-type: application/json" in head.lower()
        error = orjson.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == 400
        assert "malformed HTTP request" in error["message"]


# -- bad requests and bugs of ours ---------------------------------------------------------

_GOOD = {"model": TEST_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

_BAD: Sequence[tuple[str, bytes, int, str]] = [
    ("malformed json", b'{"model": "sim-model", "messages": [', 400, "invalid_request_error"),
    ("not an object", b"[1, 2]", 400, "invalid_request_error"),
    ("missing messages", orjson.dumps({"model": TEST_MODEL}), 400, "invalid_request_error"),
    ("empty messages", orjson.dumps({**_GOOD, "messages": []}), 400, "invalid_request_error"),
    ("messages a string", orjson.dumps({**_GOOD, "messages": "hi"}), 400, "invalid_request_error"),
    (
        "role a number",
        orjson.dumps({**_GOOD, "messages": [{"role": 1, "content": "x"}]}),
        400,
        "invalid_request_error",
    ),
    (
        "content a number",
        orjson.dumps({**_GOOD, "messages": [{"role": "user", "content": 5}]}),
        400,
        "invalid_request_error",
    ),
    ("stream a string", orjson.dumps({**_GOOD, "stream": "yes"}), 400, "invalid_request_error"),
    ("model a number", orjson.dumps({**_GOOD, "model": 5}), 400, "invalid_request_error"),
    ("unknown model", orjson.dumps({**_GOOD, "model": "gpt-9"}), 404, "invalid_request_error"),
    (
        "too large",
        orjson.dumps({**_GOOD, "messages": [{"role": "user", "content": "x" * 4000}]}),
        413,
        "invalid_request_error",
    ),
]


async def test_bad_requests_get_openai_errors_and_the_router_still_serves(
    engine_factory: EngineFactory,
) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, max_body_bytes=2048)) as router,
        aiohttp.ClientSession() as http,
    ):
        statuses: Counter[str] = Counter()
        for name, raw, status, error_type in _BAD:
            async with http.post(
                router.url + "/v1/chat/completions",
                data=raw,
                headers={"Content-Type": "application/json"},
            ) as response:
                assert response.status == status, name
                error = (await response.json())["error"]
            assert isinstance(error["message"], str) and error["message"], name
            assert error["type"] == error_type, name
            assert error["code"] == ("model_not_found" if status == 404 else status), name
            statuses[str(status)] += 1

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: read, then refused
            for _ in range(8):
                yield b" " * 512

        async with http.post(router.url + "/v1/chat/completions", data=chunks()) as response:
            assert response.status == 413
            assert (await response.json())["error"]["code"] == 413
        statuses["413"] += 1
        async with http.post(
            router.url + "/v1/completions", json={"model": TEST_MODEL, "prompt": [True]}
        ) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "prompt"
        statuses["400"] += 1
        async with http.get(router.url + "/v1/chat/completions") as response:
            assert response.status == 405
            assert (await response.json())["error"]["code"] == 405
        for code, count in statuses.items():
            assert (
                await metric(http, router, "kvrouter_rejected_requests_total", status=code) == count
            ), code
        result = await post(http, router.url, chat_body(conversation("fine", 20, 5)))
        assert result.status == 200 and len(result.text) == 8 * 4
        await assert_idle(http, router)


class _BrokenPolicy(RoundRobinPolicy):
    """A policy with a bug: what the router does with an error nobody expected."""

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> Decision:
        raise KeyError("a bug")


async def test_an_unexpected_error_is_a_json_500_and_the_router_goes_on(
    engine_factory: EngineFactory,
) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet)) as router,
        aiohttp.ClientSession() as http,
    ):
        slot = router.state.router.policies
        working = slot.current
        assert slot.install(ActivePolicy("round_robin", {}, working.version + 1, _BrokenPolicy()))
        result = await post(http, router.url, chat_body(conversation("bug", 10, 5)))
        assert result.status == 500 and result.headers["Content-Type"] == "application/json"
        error = orjson.loads(result.raw)["error"]
        assert error["type"] == "server_error" and "a bug" not in error["message"]
        assert slot.install(ActivePolicy(working.name, {}, working.version + 2, working.policy))
        assert (await post(http, router.url, chat_body(conversation("ok", 10, 5)))).status == 200
        await assert_idle(http, router)
