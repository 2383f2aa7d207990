"""What ``bench/sim/http1.py`` puts on the wire, as aiohttp would: response heads
(status line, the reply's headers, Date, Server, Connection, in aiohttp's order),
whole replies, and chunked streams (``Exchange``, the ``exchange.Exchange`` and
``exchange.Stream`` of one request)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Protocol
from urllib.parse import parse_qs

from aiohttp.http import SERVER_SOFTWARE

from bench.sim.exchange import Headers, Reply, Stream, too_large
from router.wire.http1 import http_date

_REASONS = {status.value: status.phrase for status in HTTPStatus}
_SERVER = f"Server: {SERVER_SOFTWARE}\r\n".encode()
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
TEXT = "text/plain; charset=utf-8"
# aiohttp's answer to a handler that failed before sending anything (web_protocol).
FAILED = Reply(500, b"500 Internal Server Error\n\nServer got itself in trouble", TEXT)


class Heads:
    """Response heads, with the status lines kept between requests."""

    __slots__ = ("_status_lines",)

    def __init__(self) -> None:
        self._status_lines: dict[tuple[str, int], bytes] = {}

    def head(self, version: str, status: int, lines: list[bytes], keep_alive: bool) -> bytes:
        """Status line, ``lines``, Date, Server, then Connection where aiohttp sends one:
        ``keep-alive`` to HTTP/1.0, ``close`` to HTTP/1.1."""
        lines.append(b"Date: %s\r\n" % http_date())
        lines.append(_SERVER)
        if keep_alive and version == "1.0":
            lines.append(b"Connection: keep-alive\r\n")
        elif not keep_alive and version == "1.1":
            lines.append(b"Connection: close\r\n")
        status_line = self._status_lines.get((version, status))
        if status_line is None:
            status_line = f"HTTP/{version} {status} {_REASONS.get(status, '')}\r\n".encode()
            self._status_lines[version, status] = status_line
        return status_line + b"".join(lines) + b"\r\n"

    def reply(self, request: Request, reply: Reply) -> bytes:
        """A whole reply; to HEAD without the body (and without a length if empty)."""
        head_only = request.method == "HEAD"
        lines = []
        if reply.content_type is not None:
            lines.append(f"Content-Type: {reply.content_type}\r\n".encode())
        if reply.body or not head_only:
            lines.append(b"Content-Length: %d\r\n" % len(reply.body))
        head = self.head(request.version, reply.status, lines, request.keep_alive)
        return head if head_only else head + reply.body


class Request:
    """One parsed request, complete with its body."""

    __slots__ = (
        "authorization",
        "body",
        "dropped_bytes",
        "expect",
        "keep_alive",
        "method",
        "param",
        "path",
        "query",
        "request_id",
        "upgrade",
        "version",
    )

    def __init__(self) -> None:
        self.method = ""
        self.path = ""
        self.param = ""  # the path parameter of a route that has one (api.param_routes)
        self.query = ""  # the raw query string, percent-encoded
        self.version = "1.1"
        self.keep_alive = True
        self.authorization = ""
        self.expect: str | None = None
        self.request_id: str | None = None  # X-Request-Id, the first one sent
        self.body: list[bytes] = []
        self.dropped_bytes = 0  # body bytes past MAX_BODY_BYTES, not kept
        self.upgrade = False


class Connection(Protocol):
    """What an ``Exchange`` writes through (``http1._Connection``)."""

    heads: Heads
    writing_paused: bool

    @property
    def open(self) -> bool: ...

    def write(self, data: bytes) -> None: ...

    async def drained(self) -> None: ...


class Exchange:
    """``exchange.Exchange`` over one connection; ``stream`` makes it a ``Stream`` too."""

    __slots__ = ("_connection", "_request", "chunked", "started")

    def __init__(self, connection: Connection, request: Request) -> None:
        self._connection = connection
        self._request = request
        self.started = False
        self.chunked = request.version == "1.1"

    def query(self, name: str) -> str | None:
        values = parse_qs(self._request.query).get(name)
        return values[-1] if values else None

    def request_id(self) -> str | None:
        return self._request.request_id

    def path_param(self) -> str:
        return self._request.param

    async def read(self) -> bytes:
        if self._request.dropped_bytes:
            raise too_large()
        return b"".join(self._request.body)

    async def stream(self, headers: Headers) -> Stream:
        request, connection = self._request, self._connection
        lines = [f"{name}: {value}\r\n".encode() for name, value in headers]
        if self.chunked:
            lines.append(b"Transfer-Encoding: chunked\r\n")
        else:
            request.keep_alive = False  # HTTP/1.0: the body ends with the connection
        head = connection.heads.head(request.version, 200, lines, request.keep_alive)
        self.started = True
        connection.write(head)
        await connection.drained()
        return self

    async def write(self, data: bytes) -> None:
        if data:
            connection = self._connection
            connection.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
            if connection.writing_paused:
                await connection.drained()

    def ready(self) -> bool:
        return self._connection.open and not self._connection.writing_paused

    def write_nowait(self, data: bytes) -> None:
        self._connection.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)

    async def end(self, data: bytes) -> None:
        if not self.chunked:
            last = data
        elif data:
            last = b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)
        else:
            last = b"0\r\n\r\n"
        self._connection.write(last)
        await self._connection.drained()
