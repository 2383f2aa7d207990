"""The router's one HTTP server (router.edge) over raw sockets: every route through one
table, whatever the request's encoding or HTTP version, in order on one connection."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import http.client
import re
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from router.edge.decoding import decode
from router.edge.message import MAX_HEAD_BYTES
from router.errors import BadRequest
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
async def one_router(factory: EngineFactory, **overrides: Any) -> AsyncIterator[RunningRouter]:
    async with engines(factory, 1) as fleet, serve_router(router_config(fleet, **overrides)) as r:
        yield r


def is_completion(body: bytes) -> bool:
    completion: dict[str, object] = orjson.loads(body)
    return completion["object"] == "chat.completion"


def is_stream(body: bytes) -> bool:
    return body.startswith(b"data: ") and body.rstrip().endswith(b"data: [DONE]")


async def test_every_route_is_answered_in_order_on_one_connection(
    engine_factory: EngineFactory,
) -> None:
    async with one_router(engine_factory) as router, connection(router) as (reader, writer):
        writer.write(
            request(b"POST", b"/v1/chat/completions", CHAT)
            + request(b"GET", b"/health")
            + request(b"POST", b"/v1/chat/completions", STREAMED)
            + request(b"GET", b"/v1/models")
            + request(b"GET", b"/metrics")
            + request(b"POST", b"/v1/chat/completions", CHAT)
        )
        answers = [await read_response(reader) for _ in range(6)]
    assert [status for status, _, _ in answers] == [200] * 6
    assert is_completion(answers[0][2]) and is_completion(answers[5][2])
    assert answers[0][1][b"x-kvrouter-worker"] == b"w0" and b"date" in answers[0][1]
    assert orjson.loads(answers[1][2])["status"] == "ok"
    assert is_stream(answers[2][2])
    assert orjson.loads(answers[3][2])["data"][0]["id"] == TEST_MODEL
    assert b"kvrouter_requests_total" in answers[4][2]


def encoded(body: bytes, coding: bytes) -> bytes:
    head = request(b"POST", b"/v1/chat/completions", body)
    return head.replace(b"Content-Type", b"Content-Encoding: %s\r\nContent-Type" % coding)


async def test_an_encoded_or_chunked_body_is_decoded_before_any_handler_reads_it(
    engine_factory: EngineFactory,
) -> None:
    import brotli  # type: ignore[import-untyped]  # the test extra installs both
    import zstandard

    codings = {
        b"gzip": gzip.compress(CHAT),
        b"deflate": zlib.compress(CHAT),
        b"br": brotli.compress(CHAT),
        b"zstd": zstandard.ZstdCompressor().compress(CHAT),
    }
    async with one_router(engine_factory) as router, connection(router) as (reader, writer):
        for coding, body in codings.items():
            writer.write(encoded(body, coding))
            status, _, answer = await read_response(reader)
            assert status == 200 and is_completion(answer), (coding, answer)
        chunks = b"%x\r\n%s\r\n0\r\n\r\n" % (len(CHAT), CHAT)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunks
        )
        status, _, answer = await read_response(reader)
        assert status == 200 and is_completion(answer), answer
        # A passthrough route reads the same decoded body.
        tokenize = orjson.dumps({"model": TEST_MODEL, "prompt": "hi"})
        writer.write(
            encoded(gzip.compress(tokenize), b"gzip").replace(b"/v1/chat/completions", b"/tokenize")
        )
        status, _, answer = await read_response(reader)
        assert status == 200 and orjson.loads(answer)["count"] > 0, answer


async def test_a_body_that_is_not_its_encoding_or_inflates_past_the_limit_is_refused(
    engine_factory: EngineFactory,
) -> None:
    bomb = gzip.compress(b"{" + b" " * (4 << 20) + b"}")  # 4 KiB that inflate to 4 MiB
    async with one_router(engine_factory, max_body_bytes=1 << 20) as router:
        for body, status, words in (
            (b"not gzip at all", 400, "could not be decoded"),
            (gzip.compress(CHAT)[:-8], 400, "could not be decoded"),  # cut short
            (bomb, 413, "larger than"),
        ):
            async with connection(router) as (reader, writer):
                writer.write(encoded(body, b"gzip"))
                got, _, answer = await read_response(reader)
                assert got == status and words in orjson.loads(answer)["error"]["message"]


async def test_an_http_1_0_client_gets_whole_and_streamed_answers_then_the_close(
    engine_factory: EngineFactory,
) -> None:
    async with one_router(engine_factory) as router:
        for body, check in ((CHAT, is_completion), (STREAMED, is_stream)):
            async with connection(router) as (reader, writer):
                http10 = request(b"POST", b"/v1/chat/completions", body).replace(b"1.1", b"1.0", 1)
                # It may ask to keep the connection; the router closes it all the same.
                writer.write(http10.replace(b"Host: x", b"Host: x\r\nConnection: keep-alive"))
                status, headers, answer = await read_response(reader)
                assert status == 200 and check(answer), answer
                assert b"transfer-encoding" not in headers  # no chunks for HTTP/1.0
                assert headers[b"connection"] == b"close"
                assert await reader.read() == b""


async def test_head_gets_the_head_alone_and_a_wrong_route_a_json_error(
    engine_factory: EngineFactory,
) -> None:
    async with one_router(engine_factory) as router, connection(router) as (reader, writer):
        writer.write(request(b"HEAD", b"/health") + request(b"GET", b"/nowhere"))
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: " in head
        status, _, answer = await read_response(reader)  # the HEAD had no body
        assert status == 404 and orjson.loads(answer)["error"]["code"] == 404


def test_no_module_of_the_router_runs_a_second_http_server() -> None:
    """aiohttp is the router's client only (probes, scrapes, discovery)."""
    root = Path(__file__).resolve().parents[2] / "router"
    servers = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if re.search(r"from aiohttp import .*\bweb\b|aiohttp\.web|aiohttp\.web_", path.read_text())
    ]
    assert servers == []


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
        worker = router.state.router.fleet.workers["w0"]
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
    async with one_router(engine_factory) as router:
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
        one_router(engine_factory) as router,
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


def test_every_coding_is_decoded_whole_and_nothing_after_it_is_taken() -> None:
    body = orjson.dumps({"a": "b" * 1000})
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    raw_deflate = raw.compress(body) + raw.flush()
    half = len(body) // 2
    assert decode(gzip.compress(body[:half]) + gzip.compress(body[half:]), b"gzip", 1 << 20) == body
    assert decode(raw_deflate, b"deflate", 1 << 20) == body  # sent raw, as some clients do
    assert decode(zlib.compress(body), b"deflate", 1 << 20) == body
    assert decode(b"", b"gzip", 1 << 20) == b""  # no body: nothing was encoded
    for wrong in (zlib.compress(body) + b"garbage", gzip.compress(body)[:-4]):
        with pytest.raises(BadRequest, match="could not be decoded"):
            decode(wrong, b"deflate" if wrong.startswith(b"x") else b"gzip", 1 << 20)


def test_a_zstd_frame_that_asks_for_a_window_past_8_mib_is_refused() -> None:
    import zstandard

    body = bytes(range(256)) * 8192  # 2 MiB
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=24)  # 16 MiB
    # Streamed, the frame keeps its window (with the size known, zstd would shrink it).
    streamed = zstandard.ZstdCompressor(compression_params=params).compressobj()
    framed = streamed.compress(body) + streamed.flush()
    assert zstandard.get_frame_parameters(framed).window_size == 16 << 20
    with pytest.raises(BadRequest, match="could not be decoded"):
        decode(framed, b"zstd", 32 << 20)
    assert decode(zstandard.ZstdCompressor().compress(body), b"zstd", 32 << 20) == body


async def test_an_absolute_target_two_codings_and_an_empty_encoded_body_are_read_right(
    engine_factory: EngineFactory,
) -> None:
    async with one_router(engine_factory) as router:
        async with connection(router) as (reader, writer):
            absolute = request(b"POST", b"http://x/v1/chat/completions", CHAT)
            writer.write(absolute + request(b"GET", b"/health", b"", b"Content-Encoding: gzip"))
            status, _, answer = await read_response(reader)
            assert status == 200 and is_completion(answer), answer
            status, _, answer = await read_response(reader)
            assert status == 200 and orjson.loads(answer)["status"] == "ok", answer
        async with connection(router) as (reader, writer):
            # gzip, then gzip again: a second header is a second coding.
            twice = encoded(gzip.compress(CHAT), b"gzip").replace(
                b"Content-Type", b"Content-Encoding: gzip\r\nContent-Type"
            )
            writer.write(twice)
            status, _, answer = await read_response(reader)
            assert status == 415 and b"two Content-Encodings" in answer, answer
