"""How a handler answers a client (``Reply``), and its bytes on the connection as HTTP/1.1
puts them (``ConnectionReply``).

A stream is chunked, its head held back until its first data so that both leave in one
write. To an HTTP/1.0 client (which knows no chunks) a stream is the body up to the
connection's close; the connection always closes after its answer. A HEAD request gets
the head alone.
"""

from __future__ import annotations

from typing import Protocol

from router.wire import http1


class Reply(Protocol):
    """The client's side of one request, as a handler that relays answers it: either
    ``whole`` once, or ``start``, any ``write``s and ``end`` (which may carry the last
    data: one write for what arrived together). A write to a client that went away
    raises ``ConnectionResetError``."""

    async def whole(self, status: int, headers: http1.Headers, body: bytes) -> None: ...

    async def start(self, status: int, headers: http1.Headers) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def end(self, last: bytes = b"") -> None: ...

    def client_gone(self) -> bool:
        """The client's connection is known to be closed: a write would raise."""
        ...


class Connection(Protocol):
    """What a reply writes to (``router.edge.connection.ClientConnection``)."""

    @property
    def closed(self) -> bool: ...

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


class ConnectionReply:
    __slots__ = ("_chunked", "_connection", "_head", "_head_only", "ended", "keep_alive", "started")

    def __init__(
        self, connection: Connection, keep_alive: bool, http10: bool, head_only: bool
    ) -> None:
        self._connection = connection
        self.keep_alive = keep_alive and not http10
        self._chunked = not http10
        self._head_only = head_only
        self.started = False
        self.ended = False
        self._head = b""

    async def whole(self, status: int, headers: http1.Headers, body: bytes) -> None:
        self.started = True
        framing = http1.content_length(len(body))
        head = http1.head(status, headers, framing, not self.keep_alive)
        self._connection.write(head if self._head_only else head + body)
        self.ended = True

    async def start(self, status: int, headers: http1.Headers) -> None:
        self.started = True
        framing = http1.CHUNKED if self._chunked else b""
        self._head = http1.head(status, headers, framing, not self.keep_alive)

    async def write(self, data: bytes) -> None:
        connection = self._connection
        head, self._head = self._head, b""
        connection.write(head + self._framed(data))
        await connection.drain()

    async def end(self, last: bytes = b"") -> None:
        head, self._head = self._head, b""
        if self._head_only:
            tail = b""
        elif self._chunked:
            tail = http1.chunk(last) + http1.LAST_CHUNK if last else http1.LAST_CHUNK
        else:
            tail = last
        self._connection.write(head + tail)
        self.ended = True

    def _framed(self, data: bytes) -> bytes:
        if self._head_only or not data:  # an empty chunk would end the stream
            return b""
        return http1.chunk(data) if self._chunked else data

    def client_gone(self) -> bool:
        return self._connection.closed
