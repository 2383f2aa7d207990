"""The aiohttp app behind the router's own server: what ``router.front`` does not serve
itself (every route but the two completion routes in their common shape) it hands here.

A ``Bridge`` is one aiohttp ``RequestHandler`` per client connection that needs one,
reading from an in-memory transport: the front writes each request to it as bytes, its
body whole behind a Content-Length, and what the handler writes goes straight to the
client's transport. aiohttp calls ``log_access`` once it has written a response (or found
the client gone), which tells the front the connection is its own again; a handler that
closes its transport wants the client's connection closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from router.errors import BadRequest, RouterError


def refusal_body(status: int, message: str | None) -> bytes:
    """The JSON body of a refusal aiohttp makes itself (its own text says only which
    rule the bytes broke; none of the request is echoed)."""
    if status >= 500:
        return orjson.dumps(RouterError("internal error").body())
    error = BadRequest(f"malformed HTTP request: {message or 'unreadable'}")
    body = error.body()
    body["error"]["code"] = status
    return orjson.dumps(body)


class JsonRefusals(RequestHandler):
    """aiohttp's request handler, its own refusals in OpenAI-shaped JSON."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if isinstance(exc, ConnectionResetError):
            # The client went away and a write to it said so before aiohttp's own
            # connection_lost did: a disconnect (the proxy counted it), not an error.
            # aiohttp ends the connection quietly on a ConnectionError from here.
            raise ConnectionError("the client went away") from exc
        super().handle_error(request, status, exc, message)  # logs it; raises if answered
        if isinstance(exc, HttpProcessingError) and exc.message:
            message = exc.message
        json = web.Response(
            status=status,
            body=refusal_body(status, message),
            content_type="application/json",
        )
        json.force_close()  # as aiohttp's: the connection's bytes cannot be trusted
        return json


class _Passthrough(asyncio.Transport):
    """What the bridged handler writes to: the client's transport, but for reading
    (the front feeds the handler) and closing (the front closes, once told to)."""

    def __init__(self, client: asyncio.Transport, closed: Callable[[], None]) -> None:
        super().__init__()
        self._client = client
        self._closed = closed
        self._closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._client.write(data)

    def writelines(self, lines: Any) -> None:
        self._client.writelines(lines)

    def is_closing(self) -> bool:
        return self._closing or self._client.is_closing()

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            self._closed()

    def abort(self) -> None:
        self.close()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._client.get_extra_info(name, default)

    def get_write_buffer_size(self) -> int:
        return self._client.get_write_buffer_size()

    def can_write_eof(self) -> bool:
        return False

    def is_reading(self) -> bool:
        return True

    def pause_reading(self) -> None:
        pass  # the front hands over one request at a time: nothing to hold back

    def resume_reading(self) -> None:
        pass


class Bridge(JsonRefusals):
    """One client connection's aiohttp handler, fed by the front."""

    def __init__(
        self,
        manager: web.Server,
        responded: Callable[[bool], None],
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, loop=asyncio.get_running_loop(), **kwargs)
        self._responded = responded

    def attach(self, client: asyncio.Transport, closed: Callable[[], None]) -> None:
        self.connection_made(_Passthrough(client, closed))

    def log_access(
        self, request: BaseRequest, response: web.StreamResponse, time: float | None
    ) -> None:
        super().log_access(request, response, time)
        # Its writes are in the client's transport already; the front goes on with the
        # connection's next request after this step (aiohttp is still in its own).
        asyncio.get_running_loop().call_soon(self._responded, bool(response.keep_alive))
