"""The router's own HTTP server (router.front) over raw sockets: the completion routes it
serves itself, everything else it hands to the aiohttp app, in order on one connection."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import http.client
from collections.abc import AsyncIterator

import orjson
from aiohttp import web

from bench.loopback import serve_on_loopback
from router.app import create_app as create_router_app
from router.front_request import MAX_HEAD_BYTES
from router.server import RouterRunner
from router.state import STATE_KEY
from tests.conftest import TEST_MODEL, EngineFactory, RunningRouter, router_config, serve_router
from tests.router_client import engines

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]
CHAT = orjson.dumps(
    {"model": TEST_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
)
STREAMED = orjson.dumps({**orjson.loads(CHAT), "stream": True})


def request(method: bytes, path: bytes, body: bytes = b"", *headers: bytes) -> bytes:
    head = [b"%s %s HTTP/1.1" % (method, path), b"Host: x", *headers]
    if body or method == b"POST":
        head += [b"Content-Type: application/json", b"Content-Length: %d" % len(body)]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    """One response: status, headers (lower-case names) and body, chunked or not."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
    if headers.get(b"transfer-encoding") == b"chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            body += await reader.readexactly(size)
            await reader.readexactly(2)
        await reader.readexactly(2)
        return status, headers, body
    if b"content-length" in headers:
        return status, headers, await reader.readexactly(int(headers[b"content-length"]))
    return status, headers, await reader.read()  # close-delimited


@contextlib.asynccontextmanager
async def connection(router: RunningRouter) -> AsyncIterator[Connection]:
    host, port = router.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@contextlib.asynccontextmanager
async def router_seen_by_app(
    factory: EngineFactory,
) -> AsyncIterator[tuple[RunningRouter, list[str]]]:
    """A router, and the paths of the responses the aiohttp app prepared."""
    paths: list[str] = []

    async def seen(request: web.Request, response: web.StreamResponse) -> None:
        paths.append(request.path)

    async with engines(factory, 1) as fleet:
        config = router_config(fleet)
        app = create_router_app(config)
        app.on_response_prepare.append(seen)
        async with serve_on_loopback(app, runner_class=RouterRunner) as url:
            yield RunningRouter(url, app, config), paths


def is_completion(body: bytes) -> bool:
    completion: dict[str, object] = orjson.loads(body)
    return completion["object"] == "chat.completion"


def is_stream(body: bytes) -> bool:
    return body.startswith(b"data: ") and body.rstrip().endswith(b"data: [DONE]")


async def test_the_completion_routes_are_served_without_the_app(
    engine_factory: EngineFactory,
) -> None:
    async with router_seen_by_app(engine_factory) as (router, app_paths):
        async with connection(router) as (reader, writer):
            for body, check in ((CHAT, is_completion), (STREAMED, is_stream)):
                writer.write(request(b"POST", b"/v1/chat/completions", body))
                status, headers, answer = await read_response(reader)
                assert status == 200 and check(answer), answer
                assert headers[b"x-kvrouter-worker"] == b"w0"
                assert b"date" in headers
            writer.write(request(b"GET", b"/health"))
            status, _, answer = await read_response(reader)
            assert status == 200 and orjson.loads(answer)["status"] == "ok"
        assert app_paths == ["/health"]  # the app saw only what the front handed it


async def test_pipelined_requests_are_answered_in_order_across_both_servers(
    engine_factory: EngineFactory,
) -> None:
    async with router_seen_by_app(engine_factory) as (router, app_paths):
        async with connection(router) as (reader, writer):
            writer.write(
                request(b"POST", b"/v1/chat/completions", CHAT)
                + request(b"GET", b"/health")
                + request(b"POST", b"/v1/chat/completions", STREAMED)
                + request(b"GET", b"/v1/models")
                + request(b"POST", b"/v1/chat/completions", CHAT)
            )
            answers = [await read_response(reader) for _ in range(5)]
        assert [status for status, _, _ in answers] == [200] * 5
        assert is_completion(answers[0][2]) and is_completion(answers[4][2])
        assert orjson.loads(answers[1][2])["status"] == "ok"
        assert is_stream(answers[2][2])
        assert orjson.loads(answers[3][2])["data"][0]["id"] == TEST_MODEL
        assert app_paths == ["/health", "/v1/models"]


async def test_what_the_front_does_not_serve_itself_the_app_still_does(
    engine_factory: EngineFactory,
) -> None:
    async with router_seen_by_app(engine_factory) as (router, app_paths):
        async with connection(router) as (reader, writer):
            # A gzip body (the app decodes it) and a chunked one (the front's parser
            # does), on one keep-alive connection.
            writer.write(
                request(b"POST", b"/v1/chat/completions", gzip.compress(CHAT)).replace(
                    b"Content-Type", b"Content-Encoding: gzip\r\nContent-Type"
                )
            )
            status, _, answer = await read_response(reader)
            assert status == 200 and is_completion(answer), answer
            chunks = b"%x\r\n%s\r\n0\r\n\r\n" % (len(CHAT), CHAT)
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" + chunks
            )
            status, _, answer = await read_response(reader)
            assert status == 200 and is_completion(answer), answer
        async with connection(router) as (reader, writer):
            # HTTP/1.0: the app answers, and the connection ends with the answer.
            writer.write(request(b"POST", b"/v1/chat/completions", CHAT).replace(b"1.1", b"1.0", 1))
            status, _, answer = await read_response(reader)
            assert status == 200 and is_completion(answer), answer
            assert await reader.read() == b""
        assert app_paths == ["/v1/chat/completions", "/v1/chat/completions"]


async def test_a_head_that_never_ends_is_refused_before_it_fills_memory(
    engine_factory: EngineFactory,
) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet)) as router,
        connection(router) as (reader, writer),
    ):
        # One header whose value never ends: no header limit can see it.
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        piece = b"a" * 65536
        with contextlib.suppress(ConnectionError):
            for _ in range(MAX_HEAD_BYTES // len(piece) + 2):
                writer.write(piece)
                await writer.drain()
        status, _, answer = await read_response(reader)
        assert status == 400, answer
        assert "head is too long" in orjson.loads(answer)["error"]["message"]


async def test_a_client_that_leaves_mid_stream_frees_its_worker(
    engine_factory: EngineFactory,
) -> None:
    async with engines(engine_factory, 1) as fleet, serve_router(router_config(fleet)) as router:
        long = orjson.dumps({**orjson.loads(STREAMED), "max_tokens": 2000})
        async with connection(router) as (reader, writer):
            writer.write(request(b"POST", b"/v1/chat/completions", long))
            await reader.readuntil(b"data: ")  # the stream has begun
        worker = router.app[STATE_KEY].router.fleet.workers["w0"]
        for _ in range(100):
            if worker.outstanding_requests == 0:
                break
            await asyncio.sleep(0.02)
        assert worker.outstanding_requests == 0


def chunked_with_trailer(path: bytes, body: bytes, *trailer: bytes) -> bytes:
    head = [
        b"POST %s HTTP/1.1" % path,
        b"Host: x",
        b"Content-Type: application/json",
        b"Transfer-Encoding: chunked",
    ]
    chunk = b"%x\r\n%s\r\n" % (len(body), body)
    return b"\r\n".join(head) + b"\r\n\r\n" + chunk + b"0\r\n" + b"".join(trailer) + b"\r\n"


async def test_trailer_fields_never_become_request_headers(
    engine_factory: EngineFactory,
) -> None:
    responses = orjson.dumps({"model": TEST_MODEL, "input": "hi", "max_output_tokens": 2})
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, api_keys=("key",))) as router,
        connection(router) as (reader, writer),
    ):
        for path, body in ((b"/v1/chat/completions", CHAT), (b"/v1/responses", responses)):
            writer.write(chunked_with_trailer(path, body, b"Authorization: Bearer key\r\n"))
            status, _, answer = await read_response(reader)
            assert status == 401, answer  # a key in the trailer is no key
        # A Content-Encoding in the trailer does not make the plain body a gzip one.
        writer.write(
            chunked_with_trailer(
                b"/v1/chat/completions",
                CHAT,
                b"Content-Encoding: gzip\r\n",
            ).replace(b"Host: x", b"Host: x\r\nAuthorization: Bearer key")
        )
        status, _, answer = await read_response(reader)
        assert status == 200 and is_completion(answer), answer


def post_too_large(url: str, size: int) -> tuple[int, bytes]:
    """As a blocking client does (http.client, under requests and urllib3): the whole
    body sent, then the answer read; a reset while sending is an error, not an answer."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.putrequest("POST", "/v1/chat/completions")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(size))
        connection.endheaders()
        piece = b"x" * (1024 * 1024)
        for _ in range(size // len(piece)):
            connection.send(piece)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


async def test_a_body_over_the_limit_gets_its_413_while_the_client_is_still_sending(
    engine_factory: EngineFactory,
) -> None:
    async with engines(engine_factory, 1) as fleet:
        config = router_config(fleet, max_body_bytes=1024 * 1024)
        async with serve_router(config) as router:
            status, answer = await asyncio.to_thread(post_too_large, router.url, 200 << 20)
    assert status == 413
    assert "larger than" in orjson.loads(answer)["error"]["message"]


async def test_a_request_without_one_host_is_refused_and_engines_stay_anonymous(
    engine_factory: EngineFactory,
) -> None:
    chat = request(b"POST", b"/v1/chat/completions", CHAT)
    async with router_seen_by_app(engine_factory) as (router, _):
        async with connection(router) as (reader, writer):
            writer.write(chat)
            status, headers, _ = await read_response(reader)
            assert status == 200
            assert b"server" not in headers  # the engine's own (aiohttp's here, uvicorn's)
        for hosts in (b"", b"Host: x\r\nHost: y\r\n"):  # none on HTTP/1.1, or two
            async with connection(router) as (reader, writer):
                writer.write(chat.replace(b"Host: x\r\n", hosts, 1))
                status, _, answer = await read_response(reader)
                assert status == 400 and b"Host" in answer, answer
        async with connection(router) as (reader, writer):  # HTTP/1.0 needs none
            writer.write(b"GET /health HTTP/1.0\r\n\r\n")
            status, _, _ = await read_response(reader)
            assert status == 200


async def test_a_pipelined_request_waiting_for_100_continue_gets_it_in_its_turn(
    engine_factory: EngineFactory,
) -> None:
    async with (
        router_seen_by_app(engine_factory) as (router, _),
        connection(router) as (reader, writer),
    ):
        waiting = request(b"POST", b"/v1/chat/completions", b"", b"Expect: 100-continue")
        waiting = waiting.replace(b"Content-Length: 0", b"Content-Length: %d" % len(CHAT))
        writer.write(request(b"POST", b"/v1/chat/completions", STREAMED) + waiting)
        status, _, answer = await read_response(reader)  # the first, answered first
        assert status == 200 and is_stream(answer)
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(CHAT)  # the body, only now
        status, _, answer = await read_response(reader)
        assert status == 200 and is_completion(answer)
