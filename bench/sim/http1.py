"""The simulated engine's own HTTP/1.1 server: ``bench/sim/api.py``'s endpoints on an
asyncio protocol and httptools (llhttp, the parser uvicorn, and so vLLM, runs on).

Why not aiohttp here: a simulated request costs the engine about a millisecond of CPU,
and aiohttp's request and response objects, middlewares and writers took a seventh of
it (``kvrouter bench engine-cpu``, interleaved runs). This layer parses in C, keeps two
small objects per request and frames each chunk in one ``transport.write``.

What a client sees is what the aiohttp front-end (``bench/sim/server.py``) sends, byte
for byte but the date: status lines, headers in aiohttp's order and its ``Server``
value, ``Connection`` headers and keep-alive, chunked streams (an HTTP/1.0 stream ends
with the connection instead), ``100 Continue`` and aiohttp's 417, HEAD on every GET
route, the JSON 401/404/405/413 errors, and for a request the engine dropped a 500 (or,
mid-stream, the connection closed). ``tests/sim/test_sim_http.py`` compares the two. Only a
malformed request's 400 differs: its text is the parser's own.

Bounds: request lines and header fields of ``MAX_LINE_BYTES``, ``MAX_HEADERS`` headers,
``MAX_BODY_BYTES`` of body kept (past it the body is read and dropped, and endpoints that
read it answer 413), ``MAX_PIPELINED`` requests parsed ahead of the one being answered
(reading pauses past it), writes that wait while the client's socket buffer is full, and
idle keep-alive connections closed after ``KEEPALIVE_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import cast
from urllib.parse import unquote

import httptools

from bench.sim.api import Endpoint, api_key_check, match_param, param_routes, routes
from bench.sim.config import EngineConfig
from bench.sim.engine import Engine, running_engine
from bench.sim.exchange import MAX_BODY_BYTES, Reply, error_reply, unauthorized
from bench.sim.http1_wire import CONTINUE, FAILED, TEXT, Exchange, Heads, Request
from bench.sim.request_fields import ApiError

log = logging.getLogger(__name__)

# aiohttp's RequestHandler defaults, so that both front-ends refuse the same heads.
MAX_LINE_BYTES = 8190
MAX_HEADERS = 128
KEEPALIVE_S = 3630.0
MAX_PIPELINED = 16
GC_YOUNG_THRESHOLD = 10_000


class _BadRequest(Exception):
    """A request head past the bounds; answered 400 like a parse error."""


class _Front:
    """What every connection of one engine shares."""

    __slots__ = ("allowed", "connections", "engine", "heads", "param_routes", "paths", "routes")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.connections: set[_Connection] = set()
        self.heads = Heads()
        self.routes: Mapping[tuple[str, str], Endpoint] = routes(engine.config.flavor)
        self.paths = {path for _, path in self.routes}
        self.param_routes = param_routes(engine.config.flavor)
        api_key = engine.config.api_key
        self.allowed = None if api_key is None else api_key_check(api_key)

    def endpoint(self, request: Request) -> Endpoint | Reply:
        """The endpoint for ``request``, or the error aiohttp's router and the API-key
        middleware would answer (in that order: the key is checked first)."""
        method = "GET" if request.method == "HEAD" else request.method
        if self.allowed is not None and not self.allowed(
            request.method, request.path, request.authorization
        ):
            return unauthorized()
        endpoint = self.routes.get((method, request.path))
        if endpoint is not None:
            return endpoint
        if request.path in self.paths:
            return error_reply(ApiError(405, "Method Not Allowed"))
        return self._param_endpoint(method, request)

    def _param_endpoint(self, method: str, request: Request) -> Endpoint | Reply:
        """The endpoint of a route with a path parameter (set on ``request``), or the
        405 or 404 aiohttp's router answers."""
        matched = False
        for (route_method, template), endpoint in self.param_routes.items():
            value = match_param(template, request.path)
            if value is not None and route_method == method:
                request.param = value
                return endpoint
            matched = matched or value is not None
        return error_reply(
            ApiError(405 if matched else 404, "Method Not Allowed" if matched else "Not Found")
        )


class _Connection(asyncio.Protocol):
    """One client connection: requests parsed as they arrive, answered one at a time."""

    def __init__(self, front: _Front) -> None:
        self.front = front
        self.heads = front.heads
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._parsing = Request()
        self._url = b""
        self._headers = 0
        self._body_bytes = 0
        self._queue: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._reading_paused = False
        self._drained: asyncio.Future[None] | None = None
        self.writing_paused = False
        # Since when (loop time) nothing was asked of this connection; None: busy.
        self._idle_since: float | None = None
        self._idle_timer: asyncio.TimerHandle | None = None

    # -- the transport ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._transport = cast(asyncio.Transport, transport)
        self.front.connections.add(self)
        self._idle_since = asyncio.get_running_loop().time()
        self._idle_timer = asyncio.get_running_loop().call_later(KEEPALIVE_S, self._check_idle)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self.front.connections.discard(self)
        self._queue.clear()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self._task is not None:
            self._task.cancel()  # the client left: abort what it asked for
        self._wake_writer()

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._wake_writer()

    def _wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    @property
    def open(self) -> bool:
        return self._transport is not None

    def write(self, data: bytes) -> None:
        """Write ``data`` now (the transport buffers what the socket does not take);
        ``ConnectionResetError`` once the client is gone."""
        if self._transport is None:
            raise ConnectionResetError("the client closed the connection")
        self._transport.write(data)

    async def drained(self) -> None:
        """Return once the client's socket buffer has room (at once, mostly)."""
        while self.writing_paused and self._transport is not None:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> asyncio.Task[None] | None:
        """Drop the connection at once (the server stops); returns the task answering
        on it, which the drop cancels."""
        if self._transport is not None:
            self._transport.abort()
        return self._task

    def _check_idle(self) -> None:
        """Close a keep-alive connection idle for ``KEEPALIVE_S``; else look again when
        it could be (one timer a connection, not one a request)."""
        loop = asyncio.get_running_loop()
        idle_since = self._idle_since
        if idle_since is not None and loop.time() - idle_since >= KEEPALIVE_S:
            self._close()
            return
        wait = KEEPALIVE_S if idle_since is None else idle_since + KEEPALIVE_S - loop.time()
        self._idle_timer = loop.call_later(wait, self._check_idle)

    # -- parsing ------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._transport is None:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No protocol is upgraded to: the request is answered, then the connection
            # ends (what follows on it is not HTTP/1.1).
            self._parsing.upgrade = True
        except httptools.HttpParserError as exc:
            # A bound our callbacks enforce comes back wrapped, as the error's context.
            cause = exc.__context__
            self._bad_request(cause if isinstance(cause, _BadRequest) else exc)

    def on_message_begin(self) -> None:
        self._parsing = Request()
        self._url = b""
        self._headers = 0
        self._body_bytes = 0
        self._idle_since = None

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_LINE_BYTES:
            raise _BadRequest(f"request line longer than {MAX_LINE_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers += 1
        if self._headers > MAX_HEADERS:
            raise _BadRequest(f"more than {MAX_HEADERS} headers")
        if len(name) > MAX_LINE_BYTES or len(value) > MAX_LINE_BYTES:
            raise _BadRequest(f"a header longer than {MAX_LINE_BYTES} bytes")
        lowered = name.lower()
        if lowered == b"authorization":
            self._parsing.authorization = value.decode("utf-8", "surrogateescape")
        elif lowered == b"expect":
            self._parsing.expect = value.decode("utf-8", "surrogateescape")
        elif lowered == b"x-request-id" and self._parsing.request_id is None:
            self._parsing.request_id = value.decode("utf-8", "surrogateescape")

    def on_headers_complete(self) -> None:
        request, parser = self._parsing, self._parser
        request.method = parser.get_method().decode("ascii")
        request.version = parser.get_http_version()
        request.keep_alive = parser.should_keep_alive()
        url = httptools.parse_url(self._url)
        path = url.path.decode("latin-1")
        request.query = (url.query or b"").decode("latin-1")
        request.path = unquote(path) if "%" in path else path
        if (
            request.expect is not None
            and request.version == "1.1"
            and request.expect.lower() == "100-continue"
            and self._transport is not None
        ):
            self._transport.write(CONTINUE)

    def on_body(self, body: bytes) -> None:
        request = self._parsing
        self._body_bytes += len(body)
        if self._body_bytes > MAX_BODY_BYTES:
            request.dropped_bytes += len(body)
            request.body = []
        else:
            request.body.append(body)

    def on_message_complete(self) -> None:
        self._queue.append(self._parsing)
        if len(self._queue) > MAX_PIPELINED and self._transport is not None:
            self._transport.pause_reading()
            self._reading_paused = True
        self._next()

    def _bad_request(self, exc: Exception) -> None:
        log.debug("bad request: %s", exc)
        if self._task is None and self._transport is not None:
            reply = Reply(400, str(exc).encode(), TEXT)
            request = Request()
            request.version, request.keep_alive = "1.0", False
            self._transport.write(self.heads.reply(request, reply))
        self._close()

    # -- answering ----------------------------------------------------------------------

    def _next(self) -> None:
        if self._task is not None or not self._queue or self._transport is None:
            return
        request = self._queue.popleft()
        if self._reading_paused and len(self._queue) <= MAX_PIPELINED // 2:
            self._transport.resume_reading()
            self._reading_paused = False
        self._task = asyncio.get_running_loop().create_task(self._answer(request))

    async def _answer(self, request: Request) -> None:
        exchange = Exchange(self, request)
        try:
            reply = await self._run(request, exchange)
            if reply is not None:
                self.write(self.heads.reply(request, reply))
                await self.drained()
        except asyncio.CancelledError:
            return  # the connection is gone
        except Exception as exc:
            if isinstance(exc, ConnectionResetError):
                log.info("%s %s: %s", request.method, request.path, exc)
            else:
                log.exception("error answering %s %s", request.method, request.path)
            request.keep_alive = False
            if not exchange.started and self._transport is not None:
                self._transport.write(self.heads.reply(request, FAILED))
        finally:
            self._task = None
        if not request.keep_alive or request.upgrade:
            self._close()
        elif self._transport is not None:
            if self._queue:
                self._next()
            else:
                self._idle_since = asyncio.get_running_loop().time()

    async def _run(self, request: Request, exchange: Exchange) -> Reply | None:
        """The reply to send, or None when the endpoint streamed its own."""
        expect = request.expect
        if expect is not None and request.version == "1.1" and expect.lower() != "100-continue":
            return Reply(417, f"Unknown Expect: {expect}".encode(), TEXT)
        found = self.front.endpoint(request)
        if isinstance(found, Reply):
            return found
        result = await found(self.front.engine, exchange)
        return result if isinstance(result, Reply) else None


@contextlib.asynccontextmanager
async def serving(engine: Engine, host: str, port: int) -> AsyncIterator[asyncio.Server]:
    """Serve ``engine`` on ``host``:``port`` (0: a free one) until exit."""
    front = _Front(engine)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(front), host, port, backlog=1024)
    try:
        yield server
    finally:
        server.close()
        answering = [task for c in list(front.connections) if (task := c.abort()) is not None]
        await asyncio.gather(*answering)
        await server.wait_closed()


def settle_gc() -> None:
    """Tune the collector for a process that serves, once it has started.

    What startup built is frozen out of the collector's sight (``gc.freeze``, as vLLM's
    ``freeze_gc_heap`` does after warm-up), and the young generation is collected every
    ``GC_YOUNG_THRESHOLD`` allocations instead of 700: a request's dicts, lists and
    tasks are freed by reference counting as it ends, and collecting every few hundred
    allocations walked the requests in flight over and over (five collections a run
    of ``kvrouter bench engine-cpu``, ~3% of the engine's CPU; none now). Garbage in
    cycles is still collected, later.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


async def serve(config: EngineConfig, host: str, port: int) -> None:
    """Run one engine in this process until cancelled."""
    async with running_engine(config) as engine, serving(engine, host, port):
        settle_gc()
        await asyncio.Event().wait()
