"""The router's HTTP/1.1 client to its workers: keep-alive connections per worker, bodies
passed through byte for byte, responses read as they arrive.

Not aiohttp's client: behind aiohttp's server, its request path cost 90-130 µs of CPU a
forwarded request on this project's benchmark machine against 40-55 µs for this one
(the same bare proxy, interleaved runs), and the router's whole budget is about that.
Parsing is llhttp's (``httptools``, the parser uvicorn uses); what is here is the pool,
the framing of the request and the hand-over of the response.

* A connection is reused only after its response ended cleanly and the worker allowed
  keep-alive; one the worker closed while idle leaves the pool when it closes, one idle
  for ``idle_timeout_s`` is closed.
* ``max_per_worker`` and ``max_total`` bound the open connections; a request over either
  waits for one to free up (that wait is the router's load, not the worker's failure: no
  timeout counts it).
* A connection refused or unreachable raises ``ConnectFailed``; a new connection not made
  within ``connect_timeout_s`` raises ``TimeoutError``; silence of ``read_timeout_s``
  between two chunks raises ``TimeoutError``; a connection lost or a malformed response
  raises ``UpstreamClosed``.
* A response body the reader does not keep up with stops the socket being read
  (``HIGH_WATER_BYTES``): a slow client holds the worker back, not the router's memory.
* A response head is held until it is whole and parsed once (llhttp rebuilds a header
  value that arrives in pieces at every piece): over ``MAX_RESPONSE_HEAD_BYTES``, a field
  over ``MAX_FIELD_BYTES`` or more than ``MAX_HEADERS`` headers raise ``UpstreamClosed``
  and close the connection, as the router's own server refuses such a request.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections import deque
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit

import httptools

from router.wire.http1 import MAX_FIELD_BYTES, MAX_HEADERS

IDLE_TIMEOUT_S = 15.0  # what aiohttp keeps an idle connection for
HIGH_WATER_BYTES = 256 * 1024  # buffered body past which the socket is not read
# vLLM's and SGLang's heads are a few hundred bytes; a proxy in between adds a few more.
MAX_RESPONSE_HEAD_BYTES = 64 * 1024
_HEAD_ENDS = (b"\r\n\r\n", b"\n\n")
_STATUS_LINE_START = b"HTTP/"


class UpstreamClosed(ConnectionError):
    """The worker closed the connection before its response ended, or sent no HTTP."""


class ConnectFailed(ConnectionError):
    """No new connection could be made: refused, unreachable or unresolvable."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a worker listens, parsed once from its URL."""

    scheme: str
    host: str
    port: int
    host_header: bytes

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host_header = parts.netloc.rpartition("@")[2]  # never a URL's credentials
        return cls(parts.scheme, parts.hostname, port, host_header.encode("idna"))


class _HeadRefused(Exception):
    """A response head over the router's limits (raised inside llhttp's callbacks)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; its current response's state lives here too."""

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self._pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._loop = asyncio.get_running_loop()
        self._reset()

    def _reset(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._head = bytearray()  # the response head, held until it is whole
        self._head_fed = False
        self.headers: list[tuple[bytes, bytes]] = []
        self._head_waiter: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._body: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self.complete = False
        self._keep_alive = False
        self.headers_done = False
        self.error: BaseException | None = None
        self._delimited_by_close = True  # until a Content-Length or chunked says otherwise

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.complete or self._head_waiter is None:
            # Bytes after the response ended (or while idle): not HTTP we can use.
            self._fail(UpstreamClosed("the worker sent data outside a response"))
            return
        if not self._head_fed:
            head = self._whole_head(data)
            if head is None:
                return
            data = head
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            refused = exc.__context__
            why = refused if isinstance(refused, _HeadRefused) else exc
            self._fail(UpstreamClosed(f"malformed response from the worker: {why}"))

    def _whole_head(self, data: bytes) -> bytes | None:
        """What to feed the parser once the head is whole (the head and whatever came
        after it); None while it is not, or when it broke a limit (then failed)."""
        head = self._head
        scanned = max(0, len(head) - 3)
        head += data
        if not head.startswith(_STATUS_LINE_START[: len(head)]):
            self._fail(UpstreamClosed("malformed response from the worker: not HTTP"))
            return None
        ends = [i for i in (head.find(end, scanned) for end in _HEAD_ENDS) if i >= 0]
        if not ends and len(head) <= MAX_RESPONSE_HEAD_BYTES:
            return None
        if not ends or min(ends) > MAX_RESPONSE_HEAD_BYTES:
            self._fail(
                UpstreamClosed(
                    f"the worker's response head is over {MAX_RESPONSE_HEAD_BYTES} bytes"
                )
            )
            return None
        self._head_fed = True
        whole = bytes(head)
        head.clear()
        return whole

    def connection_lost(self, exc: Exception | None) -> None:
        self._pool._lost(self)
        if self.complete:
            return
        if self.headers_done and self._delimited_by_close and exc is None:
            self.on_message_complete()  # the body ran to the end of the connection
            return
        self._fail(UpstreamClosed("the worker closed the connection" + (f": {exc}" if exc else "")))

    # -- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) > MAX_FIELD_BYTES or len(value) > MAX_FIELD_BYTES:
            raise _HeadRefused(f"a header field is over {MAX_FIELD_BYTES} bytes")
        if len(self.headers) >= MAX_HEADERS:
            raise _HeadRefused(f"more than {MAX_HEADERS} headers")
        self.headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length" or (
            lower == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self._delimited_by_close = False

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            # The router sends no Expect and asks no upgrade: an interim answer is none.
            # Passed on as the status, the client would wait for a final one never sent.
            raise _HeadRefused(f"an interim response ({status}) where a final one belongs")
        self.headers_done = True
        if status in (204, 304):
            self._delimited_by_close = False
        self._wake_head()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER_BYTES and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        # llhttp answers this only inside its callbacks: after them it has reset.
        self._keep_alive = self._parser.should_keep_alive()
        self.complete = True
        self._wake_head()
        self._wake()

    # -- the response, as the proxy reads it

    def _wake_head(self) -> None:
        if self._head_waiter is not None and not self._head_waiter.done():
            self._head_waiter.set_result(None)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        for future in (self._head_waiter, self._waiter):
            if future is not None and not future.done():
                future.set_exception(self.error)
        if self.transport is not None:
            self.transport.close()

    async def send(self, head: bytes, body: bytes, timeout_s: float) -> None:
        """Writes the request and waits (at most ``timeout_s``) for the response's headers."""
        self._reset()
        future = self._head_waiter = self._loop.create_future()
        assert self.transport is not None
        self.transport.writelines((head, body))
        timer = self._loop.call_later(timeout_s, _expire, future)
        try:
            await future
        finally:
            timer.cancel()

    async def read_chunk(self, timeout_s: float) -> bytes:
        while True:
            if self._body:
                chunk = b"".join(self._body) if len(self._body) > 1 else self._body[0]
                self._body.clear()
                self._buffered = 0
                if self._paused and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                return chunk
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            waiter = self._waiter = self._loop.create_future()
            timer = self._loop.call_later(timeout_s, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None

    @property
    def status(self) -> int:
        return int(self._parser.get_status_code())

    @property
    def reusable(self) -> bool:
        return (
            self.complete
            and self.error is None
            and self._keep_alive
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class UpstreamResponse:
    """A worker's response: status and headers at once, the body chunk by chunk.
    ``release()`` must be called (the proxy does, in a ``finally``): it returns the
    connection to the pool if its response ended cleanly, else closes it."""

    __slots__ = ("_connection", "_read_timeout_s", "_released", "headers", "status")

    def __init__(self, connection: _Connection, read_timeout_s: float) -> None:
        self._connection = connection
        self._read_timeout_s = read_timeout_s
        self._released = False
        self.status = connection.status
        self.headers = connection.headers

    def header(self, name: bytes) -> str | None:
        """The first value of header ``name`` (lower case), decoded as Latin-1."""
        for key, value in self.headers:
            if key.lower() == name:
                return value.decode("latin-1")
        return None

    @property
    def content_type(self) -> str:
        value = self.header(b"content-type") or "application/octet-stream"
        return value.partition(";")[0].strip()

    async def read_chunk(self) -> bytes:
        """What arrived since the last call, waiting for something; ``b""`` at the end."""
        return await self._connection.read_chunk(self._read_timeout_s)

    @property
    def ended(self) -> bool:
        """The whole body has arrived and been read: ``read_chunk`` has nothing more."""
        connection = self._connection
        return connection.complete and not connection._body

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._connection._pool._release(self._connection)


@dataclass(slots=True)
class _Slots:
    """One worker's connections: the idle ones, how many are open, who waits for one."""

    idle: list[_Connection] = field(default_factory=list)
    open: int = 0
    waiters: deque[asyncio.Future[_Connection | None]] = field(default_factory=deque)


class UpstreamPool:
    def __init__(
        self,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_per_worker: int,
        max_total: int,
        ssl_context: ssl.SSLContext | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_per_worker = max_per_worker
        self.max_total = max_total
        self._ssl = ssl_context
        self._slots: dict[Origin, _Slots] = {}
        self._total = 0
        self._blocked_on_total: deque[Origin] = deque()  # origins waiting for max_total
        self._closed = False
        self._reaper: asyncio.TimerHandle | None = None

    async def send(
        self, origin: Origin, path: bytes, header_lines: bytes, body: bytes, method: bytes = b"POST"
    ) -> UpstreamResponse:
        """Sends ``body`` to ``origin`` and returns once the response's headers are in;
        ``header_lines`` are whole header lines, each ending in CRLF (Host and
        Content-Length are added here). ``method``: any that answers with a body (not
        HEAD: the answer's Content-Length would be waited for)."""
        connection = await self._acquire(origin)
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\n%sContent-Length: %d\r\n\r\n" % (
            method,
            path,
            origin.host_header,
            header_lines,
            len(body),
        )
        try:
            await connection.send(head, body, self.read_timeout_s)
        except BaseException:
            connection.close()
            self._release(connection)
            raise
        return UpstreamResponse(connection, self.read_timeout_s)

    async def _acquire(self, origin: Origin) -> _Connection:
        if self._closed:
            raise UpstreamClosed("the router is shutting down")
        slots = self._slots.get(origin)
        if slots is None:
            slots = self._slots[origin] = _Slots()
        now = time.monotonic()
        while True:
            while slots.idle:
                connection = slots.idle.pop()  # the most recently used: warmest
                if now - connection.idle_since < self.idle_timeout_s and connection.reusable:
                    return connection
                connection.close()  # its connection_lost will free the slot
            if slots.open < self.max_per_worker and self._total < self.max_total:
                return await self._connect(origin, slots)
            handed = await self._wait(origin, slots)
            if handed is not None:
                return handed

    async def _wait(self, origin: Origin, slots: _Slots) -> _Connection | None:
        future: asyncio.Future[_Connection | None] = asyncio.get_running_loop().create_future()
        slots.waiters.append(future)
        if slots.open < self.max_per_worker:
            self._blocked_on_total.append(origin)
        try:
            return await future
        except asyncio.CancelledError:
            handed = future.result() if future.done() and not future.cancelled() else None
            if handed is not None:
                self._release(handed)  # handed over as we were cancelled
            raise
        finally:
            if future in slots.waiters:
                slots.waiters.remove(future)

    async def _connect(self, origin: Origin, slots: _Slots) -> _Connection:
        slots.open += 1
        self._total += 1
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=self._tls() if origin.scheme == "https" else None,
                )
        except TimeoutError:
            self._freed(origin, slots)
            raise
        except OSError as exc:
            self._freed(origin, slots)
            raise ConnectFailed(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        except BaseException:
            self._freed(origin, slots)
            raise
        return connection

    def _tls(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _release(self, connection: _Connection) -> None:
        """The response is done with: the connection goes back or is closed."""
        slots = self._slots.get(connection.origin)
        if slots is None or self._closed or not connection.reusable:
            connection.close()  # connection_lost frees its slot
            return
        while slots.waiters:
            waiter = slots.waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return
        connection.idle_since = time.monotonic()
        slots.idle.append(connection)
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().call_later(self.idle_timeout_s, self._reap)

    def _reap(self) -> None:
        """Closes the connections idle for ``idle_timeout_s``: one timer for the pool,
        again while any connection is idle."""
        self._reaper = None
        now, idle = time.monotonic(), 0
        for slots in list(self._slots.values()):
            for connection in list(slots.idle):
                if now - connection.idle_since >= self.idle_timeout_s:
                    connection.close()  # connection_lost frees its slot
                else:
                    idle += 1
        if idle and not self._closed:
            self._reaper = asyncio.get_running_loop().call_later(self.idle_timeout_s, self._reap)

    def _lost(self, connection: _Connection) -> None:
        """The connection closed (either side): its slot is free."""
        if connection.transport is None:
            return
        connection.transport = None
        slots = self._slots.get(connection.origin)
        if slots is None:
            return
        if connection in slots.idle:
            slots.idle.remove(connection)
        self._freed(connection.origin, slots)

    def _freed(self, origin: Origin, slots: _Slots) -> None:
        slots.open -= 1
        self._total -= 1
        if not self._wake_one(slots):
            while self._blocked_on_total:
                other = self._slots.get(self._blocked_on_total.popleft())
                if other is not None and self._wake_one(other):
                    break
        if slots.open == 0 and not slots.waiters and origin in self._slots:
            del self._slots[origin]  # a removed worker leaves nothing behind

    @staticmethod
    def _wake_one(slots: _Slots) -> bool:
        while slots.waiters:
            waiter = slots.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # try again: a slot is free
                return True
        return False

    def open_connections(self, origin: Origin | None = None) -> int:
        if origin is None:
            return self._total
        slots = self._slots.get(origin)
        return 0 if slots is None else slots.open

    async def aclose(self) -> None:
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
        for slots in list(self._slots.values()):
            for connection in list(slots.idle):
                connection.close()
            for waiter in slots.waiters:
                if not waiter.done():
                    waiter.set_exception(UpstreamClosed("the router is shutting down"))
        await asyncio.sleep(0)  # let the transports' connection_lost run
