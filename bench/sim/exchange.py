"""What an endpoint of the simulated engine sees and returns, whichever front-end
carries it (``bench/sim/server.py`` on aiohttp, ``bench/sim/http1.py`` on httptools):
the request as an :class:`Exchange`, a whole :class:`Reply` or the :class:`Stream` it
wrote, and the helpers every endpoint module shares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from bench.sim.request_fields import ApiError

MAX_BODY_BYTES = 64 * 1024 * 1024
JSON = "application/json"
Headers = Sequence[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole response. ``content_type`` None: the body (if any) goes without one."""

    status: int = 200
    body: bytes = b""
    content_type: str | None = None


class Stream(Protocol):
    """A streamed response whose head is sent: the body in pieces, then the end."""

    async def write(self, data: bytes) -> None: ...

    async def end(self, data: bytes) -> None:
        """Send ``data`` and end the body, in one write."""

    def ready(self) -> bool:
        """Whether ``write_nowait`` may be called: the front-end can write without
        awaiting, and the client's socket buffer has room."""

    def write_nowait(self, data: bytes) -> None:
        """``write`` without awaiting; only when ``ready()``."""


class Exchange(Protocol):
    """One request as an endpoint sees it."""

    def query(self, name: str) -> str | None:
        """The last value of query parameter ``name``, if given."""

    def request_id(self) -> str | None:
        """The ``X-Request-Id`` header as sent (the first, if repeated), if any."""

    def path_param(self) -> str:
        """The path's one parameter (``param_routes``), decoded; "" on other routes."""

    async def read(self) -> bytes:
        """The request body; ``ApiError`` 413 past ``MAX_BODY_BYTES``."""

    async def stream(self, headers: Headers) -> Stream:
        """Send a 200 head with ``headers`` and return the stream for the body."""


def json_reply(body: Any, status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(body), JSON)


def error_reply(exc: ApiError) -> Reply:
    return json_reply(exc.body(), exc.status)


def too_large() -> ApiError:
    return ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes")


def unauthorized() -> Reply:
    """The 401 of ``api_key_check`` (as aiohttp's ``json_response`` encoded it)."""
    return Reply(401, b'{"error": "Unauthorized"}', "application/json; charset=utf-8")


async def read_json(exchange: Exchange) -> Any:
    try:
        return orjson.loads(await exchange.read())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc


_TRUE = ("1", "true", "t", "yes", "y", "on")
_FALSE = ("0", "false", "f", "no", "n", "off")


def query_bool(exchange: Exchange, name: str) -> bool:
    """A boolean query parameter as FastAPI reads one (default false)."""
    value = exchange.query(name)
    if value is None or value.lower() in _FALSE:
        return False
    if value.lower() in _TRUE:
        return True
    raise ApiError(400, f"'{name}' must be a boolean", param=name)
