"""The keyed routes (chat, completions, Responses, Messages) on the aiohttp app. The
router's own server (``router.front``) serves them itself in their common shape; what it
hands the app (a Content-Encoding, HTTP/1.0) is served here by the same
``router.proxy.serve``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from multidict import CIMultiDict

from router.errors import PayloadTooLarge
from router.proxy import Headers, serve
from router.state import STATE_KEY
from router.wire.kinds import Kind


class AiohttpReply:
    """``router.proxy.Reply`` on an aiohttp request: ``response`` is the handler's."""

    __slots__ = ("_http", "response")

    def __init__(self, http: web.Request) -> None:
        self._http = http
        self.response: web.StreamResponse | None = None

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        self.response = web.Response(status=status, body=body, headers=_decoded(headers))

    async def start(self, status: int, headers: Headers) -> None:
        response = web.StreamResponse(status=status, headers=_decoded(headers))
        self.response = response
        await response.prepare(self._http)

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def end(self, last: bytes = b"") -> None:
        assert self.response is not None
        await self.response.write_eof(last)

    def client_gone(self) -> bool:
        transport = self._http.transport
        return transport is None or transport.is_closing()


def _decoded(headers: Headers) -> CIMultiDict[str]:
    return CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in headers)


def handler_for(kind: Kind) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(http: web.Request) -> web.StreamResponse:
        return await _handle(http, kind)

    return handle


async def _read_body(http: web.Request, limit: int) -> bytes:
    if http.content_length is not None and http.content_length > limit:
        raise PayloadTooLarge(f"request body is larger than {limit} bytes")
    try:
        return await http.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body is larger than {limit} bytes") from None


async def _handle(http: web.Request, kind: Kind) -> web.StreamResponse:
    state = http.app[STATE_KEY]
    raw = await _read_body(http, state.config.max_body_bytes)
    reply = AiohttpReply(http)
    await serve(state, kind, raw, http.raw_headers, reply)
    assert reply.response is not None, "serve answers or raises"
    return reply.response
