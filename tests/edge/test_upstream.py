"""The upstream client against real sockets on loopback: servers written here byte by
byte, so each case (keep-alive, a close-delimited body, a worker closing an idle
connection, a malformed response) is exactly what the wire carries."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from router.fleet.upstream import (
    HIGH_WATER_BYTES,
    MAX_RESPONSE_HEAD_BYTES,
    ConnectFailed,
    Origin,
    UpstreamClosed,
    UpstreamPool,
)
from router.wire.http1 import MAX_FIELD_BYTES, MAX_HEADERS

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    @property
    def origin(self) -> Origin:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return Origin.of(f"http://127.0.0.1:{port}")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                await self.handler(reader, writer)
        finally:
            writer.close()


async def read_request(reader: asyncio.StreamReader, server: Server) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    body = await reader.readexactly(length)
    server.requests.append(head + body)
    return body


def keep_alive(reply: bytes, server_box: list[Server]) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader, server_box[0])
            writer.write(reply)
            await writer.drain()

    return handler


def boxed(box: list[Server], server: Server, handler: Handler) -> Handler:
    """Hands ``server`` to a handler defined before it existed."""
    box.append(server)
    return handler


@contextlib.asynccontextmanager
async def serving(make: Callable[[Server], Handler]) -> AsyncIterator[Server]:
    server = Server(lambda r, w: asyncio.sleep(0))
    server.handler = make(server)
    server.server = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    try:
        yield server
    finally:
        server.server.close()
        for writer in server.writers:
            writer.close()
        await asyncio.sleep(0.01)


def pool(**kwargs: float) -> UpstreamPool:
    options = {"connect_timeout_s": 2.0, "read_timeout_s": 2.0, "max_per_worker": 8}
    options.update(kwargs)
    return UpstreamPool(
        options["connect_timeout_s"],
        options["read_timeout_s"],
        int(options["max_per_worker"]),
        int(options.get("max_total", 64)),
        idle_timeout_s=options.get("idle_timeout_s", 15.0),
    )


async def read_all(response: object) -> bytes:
    from router.fleet.upstream import UpstreamResponse

    assert isinstance(response, UpstreamResponse)
    body = b""
    while chunk := await response.read_chunk():
        body += chunk
    return body


async def test_keep_alive_connection_is_reused_and_request_framed() -> None:
    async with serving(lambda s: keep_alive(OK, [s])) as server:
        client = pool()
        for _ in range(3):
            response = await client.send(
                server.origin, b"/v1/completions", b"X-Request-Id: abc\r\n", b'{"a":1}'
            )
            assert response.status == 200
            assert response.content_type == "application/json"
            assert await read_all(response) == b"{}"
            response.release()
        assert server.connections == 1
        request = server.requests[0]
        assert request.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"\r\nX-Request-Id: abc\r\n" in request
        assert request.endswith(b'Content-Length: 7\r\n\r\n{"a":1}')
        await client.aclose()


async def test_idle_connections_are_closed_after_the_idle_timeout() -> None:
    async with serving(lambda s: keep_alive(OK, [s])) as server:
        client = pool(idle_timeout_s=0.2)
        responses = [await client.send(server.origin, b"/", b"", b"") for _ in range(3)]
        for response in responses:
            assert await read_all(response) == b"{}"
            response.release()
        assert client.open_connections() == 3
        await asyncio.sleep(0.6)
        assert client.open_connections() == 0
        await client.aclose()


async def test_response_not_read_to_its_end_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader, box[0])
            writer.write(OK[:-2])
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(OK[-2:])
            await writer.drain()

    box: list[Server] = []
    async with serving(lambda s: boxed(box, s, handler)) as server:
        client = pool()
        response = await client.send(server.origin, b"/", b"", b"")
        response.release()  # before the body ended: the connection is in mid-response
        response = await client.send(server.origin, b"/", b"", b"")
        assert await read_all(response) == b"{}"
        response.release()
        assert server.connections == 2
        await client.aclose()


async def test_body_delimited_by_close_ends_cleanly() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, box[0])
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npart one, ")
        await writer.drain()
        writer.write(b"part two")
        await writer.drain()

    box: list[Server] = []
    async with serving(lambda s: boxed(box, s, handler)) as server:
        client = pool()
        response = await client.send(server.origin, b"/", b"", b"x")
        assert await read_all(response) == b"part one, part two"
        response.release()
        assert client.open_connections() == 0
        await client.aclose()


async def test_connection_lost_mid_body_raises() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, box[0])
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()

    box: list[Server] = []
    async with serving(lambda s: boxed(box, s, handler)) as server:
        client = pool()
        response = await client.send(server.origin, b"/", b"", b"x")
        assert await response.read_chunk() == b"only this"
        with pytest.raises(UpstreamClosed):
            await response.read_chunk()
        response.release()
        await client.aclose()


async def test_idle_connection_closed_by_worker_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, box[0])
        writer.write(OK)
        await writer.drain()  # then closes: the engine's keep-alive timeout ran out

    box: list[Server] = []
    async with serving(lambda s: boxed(box, s, handler)) as server:
        client = pool()
        for _ in range(2):
            response = await client.send(server.origin, b"/", b"", b"")
            assert await read_all(response) == b"{}"
            response.release()
            for _ in range(50):  # until the close reaches the client
                if client.open_connections() == 0:
                    break
                await asyncio.sleep(0.01)
            assert client.open_connections() == 0
        assert server.connections == 2
        await client.aclose()


async def test_refused_connection_is_connect_failed() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = pool()
    with pytest.raises(ConnectFailed):
        await client.send(Origin.of(f"http://127.0.0.1:{port}"), b"/", b"", b"")
    assert client.open_connections() == 0
    await client.aclose()


async def test_silence_past_read_timeout_raises_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, box[0])
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await asyncio.sleep(30)

    box: list[Server] = []
    async with serving(lambda s: boxed(box, s, handler)) as server:
        client = pool(read_timeout_s=0.2)
        response = await client.send(server.origin, b"/", b"", b"")
        assert await response.read_chunk() == b"abc"
        with pytest.raises(TimeoutError):
            await response.read_chunk()
        response.release()
        assert client.open_connections() == 0 or not server.requests[1:]
        await client.aclose()


async def test_no_headers_within_read_timeout_raises_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, box[0])
        await asyncio.sleep(30)

    box: list[Server] = []
    async with serving(lambda s: boxed(box, s, handler)) as server:
        client = pool(read_timeout_s=0.2)
        with pytest.raises(TimeoutError):
            await client.send(server.origin, b"/", b"", b"")
        await asyncio.sleep(0)
        assert client.open_connections() == 0  # a connection in that state is not kept
        await client.aclose()


async def test_malformed_response_is_upstream_closed() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, box[0])
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    box: list[Server] = []
    async with serving(lambda s: boxed(box, s, handler)) as server:
        client = pool()
        with pytest.raises(UpstreamClosed):
            await client.send(server.origin, b"/", b"", b"")
        await client.aclose()


async def test_requests_over_the_worker_limit_wait_for_a_connection() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader, box[0])
            await release.wait()
            writer.write(OK)
            await writer.drain()

    box: list[Server] = []
    async with serving(lambda s: boxed(box, s, handler)) as server:
        client = pool(max_per_worker=1)

        async def one() -> bytes:
            response = await client.send(server.origin, b"/", b"", b"")
            try:
                return await read_all(response)
            finally:
                response.release()

        tasks = [asyncio.create_task(one()) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert client.open_connections() == 1
        cancelled = asyncio.create_task(one())
        await asyncio.sleep(0.05)
        cancelled.cancel()  # a waiter that gives up takes nothing with it
        release.set()
        assert await asyncio.gather(*tasks) == [b"{}"] * 3
        assert server.connections == 1
        with contextlib.suppress(asyncio.CancelledError):
            await cancelled
        await client.aclose()


async def test_unread_body_stops_the_socket_being_read() -> None:
    size = HIGH_WATER_BYTES * 8

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, box[0])
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()

    box: list[Server] = []
    async with serving(lambda s: boxed(box, s, handler)) as server:
        client = pool()
        response = await client.send(server.origin, b"/", b"", b"")
        await asyncio.sleep(0.3)  # the worker sends as fast as it can; nobody reads
        held = response._connection._buffered
        assert HIGH_WATER_BYTES < held < size  # reading stopped past the high-water mark
        assert len(await read_all(response)) == size
        response.release()
        await client.aclose()


def test_origin_from_url() -> None:
    origin = Origin.of("https://user:secret@engine-0.svc:8443/ignored")
    assert (origin.scheme, origin.host, origin.port) == ("https", "engine-0.svc", 8443)
    assert origin.host_header == b"engine-0.svc:8443"
    assert Origin.of("http://[::1]:8000").host == "::1"
    with pytest.raises(ValueError):
        Origin.of("ftp://x")


async def endless_head(piece: bytes, sent: list[int], writer: asyncio.StreamWriter) -> None:
    """A status line, then ``piece`` again and again until the router hangs up."""
    writer.write(b"HTTP/1.1 200 OK\r\n")
    while True:
        writer.write(piece)
        sent[0] += len(piece)
        await writer.drain()
        await asyncio.sleep(0)  # each piece its own segment, as a slow worker sends them


@pytest.mark.parametrize(
    "piece",
    [b"X-Many: small\r\n", b"v" * 200],
    ids=["headers-without-end", "a-value-without-end"],
)
async def test_a_head_that_never_ends_is_refused_at_the_limit(piece: bytes) -> None:
    sent = [0]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, box[0])
        if piece.startswith(b"v"):
            writer.write(b"HTTP/1.1 200 OK\r\nX-Long: ")
        await endless_head(piece, sent, writer)

    box: list[Server] = []
    async with serving(lambda s: boxed(box, s, handler)) as server:
        client = pool(read_timeout_s=30.0)
        with pytest.raises(UpstreamClosed, match=f"over {MAX_RESPONSE_HEAD_BYTES} bytes"):
            await client.send(server.origin, b"/", b"", b"")
        # The router hung up at its limit; the worker's writes beyond are what the socket
        # buffers held when it noticed.
        assert sent[0] < 8 * MAX_RESPONSE_HEAD_BYTES
        await client.aclose()


@pytest.mark.parametrize(
    ("head", "why"),
    [
        (b"X-Big: " + b"v" * (MAX_FIELD_BYTES + 1) + b"\r\n", "header field is over"),
        (b"X-Many: small\r\n" * (MAX_HEADERS + 1), f"more than {MAX_HEADERS} headers"),
    ],
    ids=["a-field-too-long", "too-many-headers"],
)
async def test_a_whole_head_over_the_limits_is_refused(head: bytes, why: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, box[0])
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n" + head + b"\r\n{}")
        await writer.drain()
        await asyncio.sleep(1)

    box: list[Server] = []
    async with serving(lambda s: boxed(box, s, handler)) as server:
        client = pool()
        with pytest.raises(UpstreamClosed, match=why):
            await client.send(server.origin, b"/", b"", b"")
        await client.aclose()


async def test_a_head_sent_a_byte_at_a_time_is_read_whole() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, box[0])
        for byte in OK:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0)

    box: list[Server] = []
    async with serving(lambda s: boxed(box, s, handler)) as server:
        client = pool()
        response = await client.send(server.origin, b"/", b"", b"")
        assert response.status == 200
        assert response.header(b"content-type") == "application/json"
        assert await read_all(response) == b"{}"
        await client.aclose()
