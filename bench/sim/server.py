"""The simulated engine on aiohttp: ``bench/sim/api.py``'s endpoints as an application,
for an engine inside another program's event loop (the tests, the in-process
benchmarks). The engine's own process serves the same endpoints with
``bench/sim/http1.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from bench.sim.api import Endpoint, api_key_check, param_routes, routes
from bench.sim.config import EngineConfig
from bench.sim.engine import Engine, running_engine
from bench.sim.exchange import (
    MAX_BODY_BYTES,
    Headers,
    Reply,
    Stream,
    error_reply,
    too_large,
    unauthorized,
)
from bench.sim.request_fields import ApiError

ENGINE_KEY = web.AppKey("engine", Engine)
CONFIG_KEY = web.AppKey("config", EngineConfig)


def _response(reply: Reply) -> web.Response:
    headers = {} if reply.content_type is None else {"Content-Type": reply.content_type}
    return web.Response(body=reply.body, status=reply.status, headers=headers)


class _Stream:
    """``exchange.Stream`` on a prepared ``web.StreamResponse``."""

    __slots__ = ("response",)

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    async def write(self, data: bytes) -> None:
        await self.response.write(data)

    async def end(self, data: bytes) -> None:
        await self.response.write_eof(data)

    def ready(self) -> bool:
        return False  # aiohttp writes only from a coroutine

    def write_nowait(self, data: bytes) -> None:
        raise RuntimeError("aiohttp streams are not ready() for write_nowait")


class _Exchange:
    """``exchange.Exchange`` on an aiohttp request."""

    __slots__ = ("_request", "stream_response")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.stream_response: web.StreamResponse | None = None

    def query(self, name: str) -> str | None:
        values = self._request.query.getall(name, [])
        return values[-1] if values else None

    def request_id(self) -> str | None:
        return self._request.headers.get("X-Request-Id")

    def path_param(self) -> str:
        values = list(self._request.match_info.values())
        return values[0] if values else ""

    async def read(self) -> bytes:
        try:
            return await self._request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise too_large() from exc

    async def stream(self, headers: Headers) -> Stream:
        response = web.StreamResponse(headers=dict(headers))
        await response.prepare(self._request)
        self.stream_response = response
        return _Stream(response)


def _handler(endpoint: Endpoint) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        exchange = _Exchange(request)
        result = await endpoint(request.app[ENGINE_KEY], exchange)
        if isinstance(result, Reply):
            return _response(result)
        assert exchange.stream_response is not None
        return exchange.stream_response

    return handle


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own 404 and 405 (and any other HTTP error) in vLLM's error shape."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status >= 400:
            return _response(error_reply(ApiError(exc.status, exc.reason)))
        raise


def _api_key_middleware(api_key: str) -> Middleware:
    """``api.api_key_check`` on every request, answered with ``api.unauthorized``."""
    allowed = api_key_check(api_key)

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not allowed(request.method, request.path, request.headers.get("Authorization", "")):
            return _response(unauthorized())
        return await handler(request)

    return check


def create_app(config: EngineConfig) -> web.Application:
    """The engine's application; the engine loop runs for the app's lifetime."""
    middlewares: list[Middleware] = [_errors]
    if config.api_key is not None:
        middlewares.append(_api_key_middleware(config.api_key))
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app[CONFIG_KEY] = config

    async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
        async with running_engine(app[CONFIG_KEY]) as engine:
            app[ENGINE_KEY] = engine
            yield

    app.cleanup_ctx.append(engine_ctx)
    all_routes = {**routes(config.flavor), **param_routes(config.flavor)}
    for (method, path), endpoint in all_routes.items():
        if method == "GET":
            app.router.add_get(path, _handler(endpoint))  # HEAD too
        else:
            app.router.add_route(method, path, _handler(endpoint))
    return app
