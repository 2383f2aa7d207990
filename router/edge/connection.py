"""The router's HTTP/1.1 server: one ``ClientConnection`` per client connection.

httptools parses every request; every request is answered here, by the handler the
route table (``router.edge.routes``) names for its method and path, whatever its
headers or HTTP version. What no request may exceed is enforced before any handler runs:

* the request target and each header name and value: 8,190 bytes; 128 headers; the head
  as a whole 1 MiB (httptools would buffer an unterminated header without end);
* the body: ``max_body_bytes`` (413), as sent and as decoded, within
  ``clients.body_timeout_s`` of the headers (408); either closes the connection, since
  the rest of the body may still come;
* idle, or still sending its request line and headers: ``clients.keepalive_timeout_s``;
* ``Expect``: ``100-continue`` is answered, any other expectation refused (417);
* ``Content-Encoding``: one the router decodes (``router.edge.decoding``), else 415;
* bytes that are not HTTP: a JSON 400, and the connection closed.

Then, once per request: the route's guard (``router.edge.guards``), the body decoded,
the handler, and any ``RouterError`` rendered in the shape of the path's API.

Requests on one connection are answered in order (pipelined ones wait their turn; the
connection stops reading while they do). A client that leaves cancels its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from collections.abc import Callable
from typing import cast

import httptools
import orjson

from router.apis.table import error_body_for
from router.edge import guards
from router.edge.decoding import DECODED_CODINGS, decode, undecodable
from router.edge.message import MAX_HEAD_BYTES, MAX_TARGET_BYTES, Message, Refused
from router.edge.reply import ConnectionReply
from router.edge.routes import Call, Guard, Request, Routes
from router.errors import (
    BadRequest,
    ExpectationFailed,
    PayloadTooLarge,
    RequestTimeout,
    RouterError,
    UnsupportedEncoding,
)
from router.state import RouterState
from router.wire import http1
from router.wire.http1 import MAX_FIELD_BYTES, MAX_HEADERS

log = logging.getLogger(__name__)

_JSON = ((b"Content-Type", b"application/json"),)
# After a refusal, what the client still sends is read and discarded this long, or up to
# this many bytes, so that it reads its refusal rather than a reset (aiohttp does so too).
LINGER_S = 2.0
LINGER_BYTES = 256 * 1024 * 1024


class ClientConnection(asyncio.Protocol):
    def __init__(
        self,
        state: RouterState,
        routes: Routes,
        on_closed: Callable[[ClientConnection], None],
    ) -> None:
        self._state = state
        self._routes = routes
        self._on_closed = on_closed
        self._via_socket_path = False
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._message: Message | None = None  # the one being received
        self._in_head = False
        self._head_bytes = 0
        self._queue: deque[Message | Refused] = deque()  # received, awaiting their turn
        self._busy = False  # a request of this connection is being answered
        self._task: asyncio.Task[None] | None = None
        self._refused = False  # no more requests are read
        self._closing = False  # close once the current request is answered
        self._reading_paused = False
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_bytes = 0
        self._idle_until = 0.0
        self._done: asyncio.Future[None] | None = None  # for shutdown: set when idle

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # dead peers are found
        self._via_socket_path = isinstance(transport.get_extra_info("sockname"), str)
        self._arm_idle()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._transport = None
        for timer in (self._idle_timer, self._body_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        if self._task is not None:
            self._task.cancel()  # the client left: its request ends (handler_cancellation)
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the client went away"))
        self._queue.clear()
        self._on_closed(self)
        self._set_done()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            if self._linger_timer is not None:
                self._linger_bytes -= len(data)
                if self._linger_bytes <= 0:
                    self._close()
            return
        if self._in_head:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # An Upgrade the router does not do: the request is answered as if it
            # asked for none (httptools leaves its body unread: an empty one), and the
            # connection ends there.
            self._stop_reading()
        except httptools.HttpParserCallbackError as exc:
            refused = exc.__context__
            if not isinstance(refused, Refused):
                log.error("unexpected error reading a request", exc_info=refused)
                refused = Refused(RouterError("internal error"))
            self._refuse(refused)
        except httptools.HttpParserError as exc:
            log.debug("malformed HTTP request: %s", exc)
            self._refuse(Refused(BadRequest(f"malformed HTTP request: {exc}")))
        else:
            if self._in_head and self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(Refused(BadRequest("malformed HTTP request: the head is too long")))
            elif self._message is not None and not self._in_head and self._body_timer is None:
                self._arm_body_timer()

    # -- httptools callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._message = Message()
        self._in_head = True

    def on_url(self, url: bytes) -> None:
        message = self._message
        assert message is not None
        message.url += url
        if len(message.url) > MAX_TARGET_BYTES:
            raise Refused(BadRequest("malformed HTTP request: the request target is too long"))

    def on_header(self, name: bytes, value: bytes) -> None:
        message = self._message
        assert message is not None
        if len(name) > MAX_FIELD_BYTES or len(value) > MAX_FIELD_BYTES:
            raise Refused(BadRequest("malformed HTTP request: a header is too long"))
        if not self._in_head:
            # A chunked body's trailer: never merged into the header section (RFC 9110
            # section 6.5.1), or a key or an encoding could arrive after the checks.
            return
        if len(message.headers) >= MAX_HEADERS:
            raise Refused(BadRequest("malformed HTTP request: too many headers"))
        message.headers.append((name, value))

    def on_headers_complete(self) -> None:
        message = self._message
        assert message is not None
        self._in_head = False
        self._head_bytes = 0
        parser = self._parser
        message.method = parser.get_method()
        message.version = parser.get_http_version()
        message.keep_alive = parser.should_keep_alive()
        state = self._state
        length: int | None = None
        hosts = 0
        for name, value in message.headers:
            key = name.lower()
            if key == b"host":
                hosts += 1
            elif key == b"content-length":
                length = int(value) if value.isdigit() else None  # llhttp checked it
            elif key == b"expect":
                if value.lower() != b"100-continue":
                    error = ExpectationFailed(
                        f"unknown Expect {value.decode('latin-1')!r}: "
                        "only 100-continue is understood"
                    )
                    raise Refused(error)
                message.expects_continue = message.version == "1.1"
            elif key == b"content-encoding":
                coding = value.strip().lower()
                if coding not in DECODED_CODINGS:
                    raise Refused(undecodable(value))
                if message.coding != b"identity" and coding != b"identity":
                    # Two codings, as a list in one header would be.
                    raise Refused(UnsupportedEncoding("the request has two Content-Encodings"))
                if coding != b"identity":
                    message.coding = coding
        if hosts > 1 or (hosts == 0 and message.version == "1.1"):
            # RFC 9112 section 3.2: a 400 for either; two Hosts are two answers to which
            # server is meant, one a proxy in front may have read differently.
            raise Refused(BadRequest("malformed HTTP request: exactly one Host header is needed"))
        if length is not None and length > state.config.max_body_bytes:
            raise Refused(self._too_large())
        if not self._busy:
            self._send_continue()

    def _send_continue(self) -> None:
        """The 100 Continue of the request being received, if it waits for one: only
        once the answers before it are written, as they come first on the wire."""
        message = self._message
        if (
            message is not None
            and message.expects_continue
            and not self._in_head
            and not message.body  # the client did not wait: no 100 is owed
            and self._transport is not None
        ):
            message.expects_continue = False
            self._transport.write(http1.CONTINUE)

    def on_body(self, body: bytes) -> None:
        message = self._message
        assert message is not None
        message.body.append(body)
        message.body_bytes += len(body)
        if message.body_bytes > self._state.config.max_body_bytes:
            raise Refused(self._too_large())

    def on_message_complete(self) -> None:
        message, self._message = self._message, None
        assert message is not None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._queue.append(message)
        if self._busy:
            self._pause_reading()  # one waits its turn; read no more behind it
        else:
            self._next()

    # -- answering, in order ------------------------------------------------------------

    def _next(self) -> None:
        """Answers the next request received, if the connection is free for it."""
        if self._busy or self._transport is None:
            return
        if not self._queue:
            if self._closing:
                self._close()
                return
            self._send_continue()  # a pipelined request waiting for its 100, now its turn
            self._arm_idle()
            if self._reading_paused:
                self._reading_paused = False
                self._transport.resume_reading()
            self._set_done()
            return
        item = self._queue.popleft()
        self._busy = True
        self._disarm_idle()
        if isinstance(item, Refused):
            self._answer_error(item.error, close=True)
            self._linger_close()
        else:
            self._task = self._loop.create_task(self._serve(item))

    def _finished(self, keep_alive: bool) -> None:
        self._busy = False
        self._task = None
        if not keep_alive:
            self._closing = True
        self._next()

    async def _serve(self, message: Message) -> None:
        state = self._state
        method = message.method.decode("latin-1")
        target = _origin_form(message.url)
        raw_path = target.partition(b"?")[0]
        path = raw_path.decode("latin-1")
        keep_alive = message.keep_alive and not self._closing
        reply = ConnectionReply(self, keep_alive, message.version != "1.1", method == "HEAD")
        try:
            try:
                route, params = self._routes.match(method, path)
            except RouterError:
                if path.startswith("/v1/"):  # no route; one there would need a key
                    guards.check(Guard.CLIENT, message.headers, state)
                raise
            if route.guard is not Guard.OPEN:
                guards.check(route.guard, message.headers, state)
            body = message.body[0] if len(message.body) == 1 else b"".join(message.body)
            if message.coding != b"identity":
                body = decode(body, message.coding, state.config.max_body_bytes)
            request = Request(
                method, path, target, message.headers, body, params, self._via_socket_path
            )
            answer = await route.handler(Call(state, request, reply))
            if answer is not None:
                await reply.whole(answer.status, answer.headers, answer.body)
        except RouterError as exc:
            if exc.shape is None:
                exc.shape = error_body_for(path)
            if reply.started:  # a bug of ours: errors are raised before the answer starts
                log.error("error after the answer began: %r", exc)
                reply.keep_alive = False
                return
            if exc.status >= 400:
                state.metrics.rejected.labels(str(exc.status)).inc()
            reply.keep_alive = reply.keep_alive and not exc.closes_connection
            self._answer_error(exc, close=not reply.keep_alive, head_only=method == "HEAD")
            reply.ended = True
        except (asyncio.CancelledError, ConnectionError):
            reply.keep_alive = False  # the client went away (the proxy counted it)
        except Exception:
            log.exception("unexpected error serving %s %s", method, path)
            reply.keep_alive = False
            if not reply.started:
                state.metrics.rejected.labels("500").inc()
                error = RouterError("internal error")
                error.shape = error_body_for(path)
                self._answer_error(error, close=True, head_only=method == "HEAD")
        finally:
            self._finished(reply.keep_alive and reply.ended)

    def _answer_error(self, error: RouterError, close: bool, head_only: bool = False) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        headers = [*_JSON, *((k.encode(), v.encode()) for k, v in error.headers().items())]
        body = orjson.dumps(error.answer_body())
        head = http1.head(error.status, headers, http1.content_length(len(body)), close)
        transport.write(head if head_only else head + body)

    def _too_large(self) -> RouterError:
        limit = self._state.config.max_body_bytes
        return PayloadTooLarge(f"request body is larger than {limit} bytes")

    # -- the connection -----------------------------------------------------------------

    def _refuse(self, refused: Refused) -> None:
        """The rest of what the client sends is not read: its refusal is answered in
        its turn, and the connection closed."""
        self._stop_reading()
        self._message = None
        self._in_head = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if refused.error.status >= 400:
            self._state.metrics.rejected.labels(str(refused.error.status)).inc()
        self._queue.append(refused)
        self._next()

    def _stop_reading(self) -> None:
        self._refused = True
        self._closing = True

    def _pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _linger_close(self) -> None:
        """After a refusal the client may still be sending (a body over the limit): the
        answer is sent and the sending side shut, then what arrives is read and
        discarded for ``LINGER_S`` or ``LINGER_BYTES``, whichever ends first; closing at
        once would have the unread bytes reset the connection before the client reads
        its refusal."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if not transport.can_write_eof():
            self._close()
            return
        transport.write_eof()
        self._linger_bytes = LINGER_BYTES
        self._linger_timer = self._loop.call_later(LINGER_S, self._close)
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()

    async def drain(self) -> None:
        if self._write_paused:
            if self._transport is None:
                raise ConnectionResetError("the client went away")
            self._drained = self._loop.create_future()
            timeout = self._state.config.clients.write_timeout_s
            try:
                async with asyncio.timeout(timeout):
                    await self._drained
            except TimeoutError:
                if self._transport is not None:
                    self._transport.abort()  # what it holds would never be read
                raise ConnectionResetError("the client stopped reading") from None

    @property
    def closed(self) -> bool:
        transport = self._transport
        return transport is None or transport.is_closing()

    def write(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("the client went away")
        assert self._transport is not None
        self._transport.write(data)

    # -- timers -------------------------------------------------------------------------

    def _arm_idle(self) -> None:
        self._idle_until = self._loop.time() + self._state.config.clients.keepalive_timeout_s
        if self._idle_timer is None:
            self._idle_timer = self._loop.call_at(self._idle_until, self._idle_expired)

    def _disarm_idle(self) -> None:
        self._idle_until = 0.0  # the timer, when it fires, finds the connection busy

    def _idle_expired(self) -> None:
        self._idle_timer = None
        if self._busy or self._idle_until == 0.0:
            return
        if self._loop.time() < self._idle_until:
            self._idle_timer = self._loop.call_at(self._idle_until, self._idle_expired)
        elif self._message is None or self._in_head:
            self._close()  # idle, or its head still arriving after all this time
        # else its body is arriving: the body timer bounds that

    def _arm_body_timer(self) -> None:
        timeout = self._state.config.clients.body_timeout_s
        self._body_timer = self._loop.call_later(timeout, self._body_expired, timeout)

    def _body_expired(self, timeout: float) -> None:
        self._body_timer = None
        if self._message is not None and not self._in_head:
            error = RequestTimeout(f"the request body did not arrive within {timeout:g} s")
            self._refuse(Refused(error))

    # -- shutdown (router.server calls these on every connection) ------------------

    def close(self) -> None:
        """No more requests: the connection closes once the current one is answered."""
        self._closing = True
        self._stop_reading()
        if not self._busy:
            self._close()

    async def shutdown(self, timeout: float | None) -> None:  # noqa: ASYNC109
        """Waits up to ``timeout`` for the request being answered, then ends it."""
        self.close()
        if self._busy:
            self._done = self._loop.create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._done), timeout)
        if self._task is not None:
            self._task.cancel()
        if self._transport is not None:
            self._transport.abort()

    def _set_done(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(None)


def _origin_form(target: bytes) -> bytes:
    """The path and query of a request target, also in absolute form
    (``http://host/path``), which a server must accept (RFC 9112 section 3.2.2)."""
    if target[:7].lower() == b"http://" or target[:8].lower() == b"https://":
        path = target.partition(b"//")[2].partition(b"/")
        return b"/" + path[2] if path[1] else b"/"
    return target
