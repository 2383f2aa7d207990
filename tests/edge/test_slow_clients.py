"""Idle and slow clients: they hold a connection each, never the router.

Raw sockets to a served router: connections that send nothing, keep-alive connections
left idle after a request, a slowloris sending its headers a byte at a time, and one
trickling its body. A normal request is served while they hang; the keep-alive timeout
(``clients.keepalive_timeout_s``) closes the idle ones and the slow headers, and the body
timeout (``clients.body_timeout_s``) answers a slow body with a 408 and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import aiohttp
import orjson
from aiohttp import web

from router.config import ClientConfig, WorkerConfig
from tests.conftest import EngineFactory, RunningRouter, router_config, serve_router
from tests.router_client import (
    assert_idle,
    chat_body,
    conversation,
    engines,
    fake_engine,
    metric,
    post,
    wait_for,
)

IDLE_CONNECTIONS = 200
KEPT_ALIVE = 50
BYTE_PAUSE_S = 0.02  # between two trickled bytes
CHAT_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
ENDLESS_HEADER = b"X-Pad: " + b"a" * 8000  # within aiohttp's 8190-byte field limit


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def _address(router: RunningRouter) -> tuple[str, int]:
    host, port = router.url.removeprefix("http://").split(":")
    return host, int(port)


@contextlib.asynccontextmanager
async def connections(router: RunningRouter, count: int) -> AsyncIterator[list[Connection]]:
    host, port = _address(router)
    opened = [await asyncio.open_connection(host, port) for _ in range(count)]
    try:
        yield opened
    finally:
        for _, writer in opened:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def kept_alive(connection: Connection) -> None:
    """One request on ``connection``, read whole; the connection stays open."""
    reader, writer = connection
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    await reader.readexactly(length)


async def trickle(writer: asyncio.StreamWriter, data: bytes) -> None:
    """``data`` a byte at a time, until it is all sent or the router closes."""
    with contextlib.suppress(ConnectionError):
        for i in range(len(data)):
            writer.write(data[i : i + 1])
            await writer.drain()
            await asyncio.sleep(BYTE_PAUSE_S)


@contextlib.asynccontextmanager
async def trickling(writer: asyncio.StreamWriter, data: bytes) -> AsyncIterator[None]:
    task = asyncio.create_task(trickle(writer, data))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def slow_body_head(length: int) -> bytes:
    return CHAT_HEAD + b"Content-Length: %d\r\n\r\n" % length


async def test_idle_and_slow_clients_do_not_starve_a_normal_request(
    engine_factory: EngineFactory,
) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet)) as router,
        connections(router, IDLE_CONNECTIONS) as idle,
        connections(router, KEPT_ALIVE) as alive,
        connections(router, 2) as slow,
        aiohttp.ClientSession() as http,
    ):
        await asyncio.gather(*(kept_alive(c) for c in alive))
        (_, slow_headers), (_, slow_body) = slow
        slow_body.write(slow_body_head(10_000) + b'{"model": ')
        async with (
            trickling(slow_headers, CHAT_HEAD + ENDLESS_HEADER),
            trickling(slow_body, b"x" * 10_000),
        ):
            result = await post(http, router.url, chat_body(conversation("while", 20, 5)))
            assert result.status == 200 and result.usage is not None
            async with http.get(router.url + "/health") as response:
                assert response.status == 200
        # They were still hanging while the request was served: nothing closed them.
        assert not any(reader.at_eof() for reader, _ in (*idle, *alive, *slow))


async def test_idle_connections_and_slow_headers_are_closed_after_the_keepalive_timeout(
    engine_factory: EngineFactory,
) -> None:
    clients = ClientConfig(keepalive_timeout_s=0.2)
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, clients=clients)) as router,
        connections(router, 20) as idle,
        connections(router, 5) as alive,
        connections(router, 1) as slow,
    ):
        await asyncio.gather(*(kept_alive(c) for c in alive))
        reader, writer = slow[0]
        async with trickling(writer, CHAT_HEAD + ENDLESS_HEADER):
            assert await reader.read() == b""  # closed, and nothing was answered
        for reader, _ in (*idle, *alive):
            assert await reader.read() == b""


async def test_a_body_that_arrives_too_slowly_gets_a_408_and_the_connection_closes(
    engine_factory: EngineFactory,
) -> None:
    clients = ClientConfig(body_timeout_s=0.2)
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, clients=clients)) as router,
        connections(router, 1) as slow,
        aiohttp.ClientSession() as http,
    ):
        reader, writer = slow[0]
        writer.write(slow_body_head(10_000))
        async with trickling(writer, b'{"model": ' + b" " * 10_000):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
        assert head.startswith(b"HTTP/1.1 408"), head
        assert b"connection: close" in head.lower()
        error = orjson.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == 408
        assert await metric(http, router, "kvrouter_rejected_requests_total", status="408") == 1
        result = await post(http, router.url, chat_body(conversation("after", 20, 5)))
        assert result.status == 200


async def _endless_stream(request: web.Request) -> web.StreamResponse:
    """A worker streaming a long answer as fast as it is read."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    event = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 900 + b'"}}]}\n\n'
    for _ in range(100_000):  # ~100 MB, far more than any socket buffers
        await response.write(event)
    await response.write(b"data: [DONE]\n\n")
    return response


async def test_a_client_that_stops_reading_is_cut_off_and_its_request_ends() -> None:
    """A long streamed answer to a client that reads none of it: once the router's
    writes have been held back for ``write_timeout_s``, the client is cut off and the
    request ends on its worker (it held the worker's slot, and the engine's KV, for as
    long as the client kept the connection)."""
    async with fake_engine(_endless_stream) as url:
        config = router_config(
            [], workers=(WorkerConfig(url, name="w0"),), clients=ClientConfig(write_timeout_s=0.5)
        )
        async with serve_router(config) as router, aiohttp.ClientSession() as http:
            host, port = router.url.removeprefix("http://").split(":")
            body = orjson.dumps(chat_body(conversation("stuck", 20, 5)))
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            sock.sendall(  # and never reads
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await wait_for(lambda: _outcome(http, router, "client_disconnect"), timeout_s=30)
            await assert_idle(http, router, wait_s=5)
            sock.close()


async def _outcome(http: aiohttp.ClientSession, router: RunningRouter, outcome: str) -> bool:
    return await metric(http, router, "kvrouter_requests_total", outcome=outcome) == 1
