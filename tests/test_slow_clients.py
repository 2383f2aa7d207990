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
from collections.abc import AsyncIterator

import aiohttp
import orjson

from router.config import ClientConfig
from tests.conftest import EngineFactory, RunningRouter, router_config, serve_router
from tests.router_client import chat_body, conversation, engines, metric, post

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
