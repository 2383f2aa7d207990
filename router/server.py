"""The aiohttp server the router runs on: what aiohttp answers and logs by itself, before
any of the router's handlers or middlewares see a request.

aiohttp refuses HTTP its parser cannot read (a bad request line, header or chunk, a
header too long) with a plain-text 400 and logs each at ERROR with a traceback. Every
answer of the router is OpenAI-shaped JSON, so ``RouterRunner`` serves the app with a
request handler whose refusals are too, and ``MALFORMED_HTTP_FILTER`` keeps those
refusals out of the log unless ``aiohttp.server`` logs at DEBUG: one client sending
garbage would otherwise fill it. A handler that ends on ``ConnectionResetError`` (the
client left while the proxy wrote to it) ends its connection without a logged error.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from router.errors import BadRequest, RouterError


class _MalformedHttpFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is None or not isinstance(record.exc_info[1], HttpProcessingError):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.msg = f"{record.msg}: {record.exc_info[1]!r}"
        record.exc_info = None
        return True


MALFORMED_HTTP_FILTER = _MalformedHttpFilter()


def refusal_body(status: int, message: str | None) -> bytes:
    """The JSON body of a refusal aiohttp makes itself (its own text says only which
    rule the bytes broke; none of the request is echoed)."""
    if status >= 500:
        return orjson.dumps(RouterError("internal error").body())
    error = BadRequest(f"malformed HTTP request: {message or 'unreadable'}")
    body = error.body()
    body["error"]["code"] = status
    return orjson.dumps(body)


class _JsonRefusals(RequestHandler):
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


class _JsonRefusalServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonRefusals(self, loop=self._loop, **self._kwargs)


class RouterRunner(web.AppRunner):
    """``web.AppRunner`` whose connections refuse malformed HTTP with JSON."""

    async def _make_server(self) -> web.Server:
        return _rebuilt(await super()._make_server())


def _rebuilt(server: web.Server) -> web.Server:
    kwargs: dict[str, Any] = dict(server._kwargs)
    return _JsonRefusalServer(
        server.request_handler,
        request_factory=server.request_factory,
        handler_cancellation=server.handler_cancellation,
        loop=server._loop,
        **kwargs,
    )
