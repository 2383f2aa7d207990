"""``create_app(config)``: the router as an aiohttp application.

Each resource is owned by one ``cleanup_ctx`` generator: the upstream client session and
the router state, then the health prober task. Only what started is cleaned up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import cast

import aiohttp
from aiohttp import hdrs, web
from aiohttp.typedefs import Middleware

from router import __version__, discovery, passthrough
from router.admin import add_routes
from router.admission import Admission
from router.aio_proxy import handler_for
from router.apis.kinds import APIS, error_body_for
from router.auth import authorized, bearers
from router.config import ENGINE_TOKENIZER, RouterConfig
from router.errors import (
    BadRequest,
    ExpectationFailed,
    PayloadTooLarge,
    RequestTimeout,
    RouterError,
    Unauthenticated,
)
from router.front_request import authorized_by
from router.health import HealthProber
from router.index import LocalPrefixIndex, PrefixIndex
from router.kv_events.metrics import KvEventMetrics
from router.kv_events.subscriptions import KvEventSubscriptions
from router.membership import Membership
from router.metrics import RouterMetrics
from router.parse import header_bytes
from router.policy_slot import PolicySlot
from router.routing import Router
from router.server import MALFORMED_HTTP_FILTER
from router.shared.connect import connect
from router.shared.index import SharedPrefixIndex
from router.shared.metrics import PathMetrics, RedisMetrics
from router.shared.path import SharedPath
from router.shared.sync import RedisSync
from router.state import STATE_KEY, RouterState
from router.tokens.conversation import ContentFormat
from router.tokens.engine import EngineTokens
from router.tokens.keys import PromptKeys, TokenKeys, TokenMetrics
from router.tokens.model import ModelTokenizer
from router.upstream import UpstreamPool
from router.wire.json import json_response
from router.workers import Fleet

log = logging.getLogger(__name__)

CONFIG_KEY = web.AppKey("kvrouter_config", RouterConfig)
# On shutdown, how long the last index changes may take to reach Redis.
FINAL_FLUSH_TIMEOUT_S = 2.0
SYNC_STOP_TIMEOUT_S = 5.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI-shaped JSON body with the right status."""
    try:
        return await handler(request)
    except RouterError as exc:
        if STATE_KEY in request.app and exc.status >= 400:
            request.app[STATE_KEY].metrics.rejected.labels(str(exc.status)).inc()
        if exc.shape is None:
            exc.shape = error_body_for(request.path)
        response = json_response(exc.answer_body(), exc.status)
        response.headers.update(exc.headers())
        if exc.closes_connection:
            response.force_close()
        return response
    except web.HTTPRequestEntityTooLarge:
        return json_response(PayloadTooLarge("request body too large").body(), 413)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if STATE_KEY in request.app:
            request.app[STATE_KEY].metrics.rejected.labels(str(exc.status)).inc()
        error = RouterError(exc.reason)
        body = error.body()
        body["error"]["code"] = exc.status
        body["error"]["type"] = "invalid_request_error" if exc.status < 500 else "server_error"
        response = json_response(body, exc.status)
        if "Allow" in exc.headers:  # a 405 says which methods the path has
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except ConnectionResetError:
        raise  # the client went away: nobody to answer
    except Exception:
        # A bug of ours: logged with its traceback here, a plain OpenAI-shaped 500 there
        # (a traceback in the body would tell a client how the router is built).
        log.exception("unexpected error serving %s %s", request.method, request.path)
        if STATE_KEY in request.app:
            request.app[STATE_KEY].metrics.rejected.labels("500").inc()
        return json_response(RouterError("internal error").body(), 500)


def build_state(
    config: RouterConfig, session: aiohttp.ClientSession, upstream: UpstreamPool
) -> RouterState:
    """The router state, complete: its prober knows the workers whose capacity must be
    read from the engine (nothing is set on the state later)."""
    block_tokens = config.prefix.block_tokens
    fleet, local = Fleet(), LocalPrefixIndex()
    index: PrefixIndex = SharedPrefixIndex(local) if config.state.url else local
    metrics = RouterMetrics(fleet, index, block_tokens)
    policies = PolicySlot(config.policy, config.policy_knobs, config.seed, metrics)
    router = Router(
        fleet,
        index,
        policies,
        block_tokens,
        metrics,
        config.health.stale_after_s,
        config.log_requests,
    )
    limits = config.admission
    admission = Admission(
        limits.max_outstanding_per_worker, limits.queue_size, limits.queue_timeout_s
    )
    membership = Membership(fleet, index, metrics, router.learner, block_tokens)
    prober = HealthProber(
        fleet,
        index,
        session,
        config.health,
        block_tokens,
        set(),
        membership.worker_restarted,
        config.upstream.auth_headers,
        keys_by_tokens=config.prefix.tokenizer is not None,
        refused=lambda worker, what: metrics.worker_reads_refused.labels(worker, what).inc(),
    )
    state = RouterState(config, router, metrics, membership, session, upstream, admission, prober)
    state.tokens = _token_keys(config, metrics, session, fleet)
    for wc in config.workers:
        state.add_worker(wc)
    return state


def local_index(index: PrefixIndex) -> LocalPrefixIndex:
    """This replica's own index, under the shared one if state is shared."""
    return index.local if isinstance(index, SharedPrefixIndex) else cast(LocalPrefixIndex, index)


def _token_keys(
    config: RouterConfig, metrics: RouterMetrics, session: aiohttp.ClientSession, fleet: Fleet
) -> PromptKeys | None:
    prefix = config.prefix
    if prefix.tokenizer is None:
        return None
    if prefix.tokenizer == ENGINE_TOKENIZER:
        return EngineTokens(
            session,
            fleet,
            prefix.engine_timeout_s,
            TokenMetrics(metrics.registry),
            config.upstream.auth_headers,
            config.health.stale_after_s,
        )
    content_format = None if prefix.content_format == "auto" else prefix.content_format
    return TokenKeys(
        ModelTokenizer.from_dir(prefix.tokenizer),
        prefix.tokenizer_cache_tokens,
        TokenMetrics(metrics.registry),
        cast("ContentFormat | None", content_format),
        prefix.max_tokenized_bytes,
    )


async def health(request: web.Request) -> web.Response:
    return json_response({"status": "ok", "version": __version__})


async def ready(request: web.Request) -> web.Response:
    fleet = request.app[STATE_KEY].router.fleet
    healthy = [w.name for w in fleet.all() if w.healthy]
    return json_response(
        {"ready": bool(healthy), "healthy_workers": healthy}, status=200 if healthy else 503
    )


async def models(request: web.Request) -> web.Response:
    names = sorted(request.app[STATE_KEY].router.fleet.models())
    return json_response(
        {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "kvrouter"}
                for name in names
            ],
        }
    )


async def metrics(request: web.Request) -> web.Response:
    token = request.app[CONFIG_KEY].metrics_token
    if token and not _bearer_matches(request, token):
        raise Unauthenticated("missing or invalid metrics token")
    body = request.app[STATE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


def _session(config: RouterConfig) -> aiohttp.ClientSession:
    """The client of the probes, scrapes and discovery (requests go through the
    ``UpstreamPool``)."""
    up = config.upstream
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=up.connect_timeout_s, sock_read=up.read_timeout_s
    )
    # No cookie jar: a cookie an engine (or a proxy before it) set must not ride along.
    return aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=timeout,
        skip_auto_headers=("Accept-Encoding",),
    )


@contextlib.asynccontextmanager
async def _shared_state(state: RouterState) -> AsyncIterator[None]:
    """With ``state.url``: the Redis sync, warm-started before the app serves."""
    index = state.router.index
    if not isinstance(index, SharedPrefixIndex):
        yield
        return
    handle = connect(state.config.state.url)
    router = state.router
    sync = RedisSync(
        handle.client,
        index,
        router.fleet,
        router.learner.prefill_rate,
        router.policies,
        state.config.state,
        RedisMetrics(state.metrics.registry),
    )
    await sync.start()
    task = asyncio.create_task(sync.run(), name="kvrouter-redis-sync")
    state.router.policies.publisher = sync.publish_policy
    # The request path has connections of its own: a burst of requests must not take
    # the sync loops' (an empty pool reads as Redis being away, and costs a resync).
    path_handle = connect(state.config.state.url) if state.config.state.read_your_writes else None
    if path_handle is not None:
        state.shared_path = SharedPath(
            path_handle.client,
            index.local,
            state.config.state,
            PathMetrics(state.metrics.registry),
            lambda: sync.up and sync.has_peers(),
            sync.repairs,
        )
    try:
        yield
    finally:
        if state.shared_path is not None:
            await state.shared_path.close()
            state.shared_path = None
        if path_handle is not None:
            await path_handle.aclose()
        state.router.policies.publisher = None
        sync.stop()
        try:
            await asyncio.wait_for(task, SYNC_STOP_TIMEOUT_S)
        except TimeoutError:
            log.warning("redis sync did not stop in %.0f s", SYNC_STOP_TIMEOUT_S)
        await sync.flush(timeout_s=FINAL_FLUSH_TIMEOUT_S)
        await handle.aclose()


async def _state_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG_KEY]
    up = config.upstream
    upstream = UpstreamPool(
        up.connect_timeout_s,
        up.read_timeout_s,
        up.max_connections_per_worker,
        up.max_connections,
    )
    async with _session(config) as session, contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(upstream.aclose)
        state = build_state(config, session, upstream)
        app[STATE_KEY] = state
        if state.tokens is not None:
            stack.callback(state.tokens.close)
        prober = state.prober
        await prober.probe_all()
        tasks = [asyncio.create_task(prober.run(), name="kvrouter-health")]
        found = discovery.sources(config.discovery, session)
        if found:
            reconciler = discovery.Reconciler(state, found)
            await reconciler.reconcile()
            tasks.append(
                asyncio.create_task(
                    reconciler.run(config.discovery.interval_s), name="kvrouter-discovery"
                )
            )
        if config.prefix.tokenizer is not None:  # exact mode is possible
            subscriptions = KvEventSubscriptions(
                state.router.fleet,
                local_index(state.router.index),
                config.kv_events,
                config.prefix.block_tokens,
                KvEventMetrics(state.metrics.registry),
            )
            stack.push_async_callback(subscriptions.aclose)
            subscriptions.reconcile()
            state.kv_events = subscriptions
            tasks.append(asyncio.create_task(subscriptions.run(), name="kvrouter-kv-events"))
        try:
            async with _shared_state(state):
                yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task


def _bearer_matches(request: web.Request, token: str) -> bool:
    return authorized(header_bytes(request.headers.get("Authorization", "")), bearers([token]))


def api_key_middleware(keys: tuple[str, ...]) -> Middleware:
    """With ``api_keys`` set, /v1/ requests and the engine routes passed on without a
    version (``/tokenize``, ``/detokenize``) need ``Authorization: Bearer <one of them>``
    (or ``x-api-key: <one of them>``)."""
    accepted = bearers(keys)
    unversioned = frozenset(path for _, path, _ in passthrough.ROUTES if path[:4] != "/v1/")

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/") or request.path in unversioned:
            headers = [(k.lower(), header_bytes(v)) for k, v in request.headers.items()]
            if not authorized_by([(k.encode(), v) for k, v in headers], accepted):
                raise Unauthenticated("missing or invalid API key")
        return await handler(request)

    return check


BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def body_middleware(max_bytes: int, timeout_s: float) -> Middleware:
    """Reads the body of a POST, PUT or PATCH before its handler runs (whose own
    ``read()`` then returns it at once): within ``timeout_s`` of the headers, where aiohttp
    would wait for a trickled body forever; and what aiohttp raises on a body it cannot
    read becomes a 400. Other methods' bodies are left to aiohttp, which discards them."""

    @web.middleware
    async def read(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method in BODY_METHODS and request.body_exists:
            await _read_body(request, max_bytes, timeout_s)
        return await handler(request)

    return read


async def _read_body(request: web.Request, max_bytes: int, timeout_s: float) -> None:
    if request.content_length is not None and request.content_length > max_bytes:
        raise PayloadTooLarge(f"request body is larger than {max_bytes} bytes")
    try:
        async with asyncio.timeout(timeout_s):
            await request.read()
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body is larger than {max_bytes} bytes") from None
    except web.RequestPayloadError:
        # aiohttp decodes the body as it arrives; these bytes were not in the encoding.
        encoding = request.headers.get(hdrs.CONTENT_ENCODING, "")
        raise BadRequest(
            f"the request body could not be decoded as its Content-Encoding {encoding!r} says"
        ) from None


async def expect_handler(request: web.Request) -> web.StreamResponse | None:
    """aiohttp's handling of ``Expect``, with the refusal as OpenAI-shaped JSON: it runs
    before any middleware, so the error middleware never sees it."""
    expect = request.headers.get(hdrs.EXPECT, "")
    if expect.lower() != "100-continue":
        error = ExpectationFailed(f"unknown Expect {expect!r}: only 100-continue is understood")
        return json_response(error.body(), error.status)
    if request.version == aiohttp.HttpVersion11:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the 100 is not the response: an error may follow
    return None


async def unrouted(request: web.Request) -> web.StreamResponse:
    """What no route serves: aiohttp's 404 or 405, from a route of ours so that an
    ``Expect`` header on it meets ``expect_handler`` too."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not request.match_info.route.resource:
            allowed |= (await resource.resolve(request))[1]
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    raise web.HTTPNotFound()


def add_route(app: web.Application, method: str, path: str, handler: Handler) -> None:
    if method == "GET":  # and HEAD, as aiohttp's add_get does
        app.router.add_get(path, handler, expect_handler=expect_handler)
    else:
        app.router.add_route(method, path, handler, expect_handler=expect_handler)


def create_app(config: RouterConfig) -> web.Application:
    logging.getLogger("aiohttp.server").addFilter(MALFORMED_HTTP_FILTER)  # once: same object
    middlewares: list[Middleware] = [error_middleware]
    if config.api_keys:
        middlewares.append(api_key_middleware(config.api_keys))
    middlewares.append(body_middleware(config.max_body_bytes, config.clients.body_timeout_s))
    # Bodies are limited here (a clear 413), not by aiohttp's default 1 MiB.
    app = web.Application(
        middlewares=middlewares,
        client_max_size=config.max_body_bytes + 1,
        handler_args={"keepalive_timeout": config.clients.keepalive_timeout_s},
    )
    app[CONFIG_KEY] = config
    app.cleanup_ctx.append(_state_ctx)
    for api in APIS.values():
        add_route(app, "POST", api.path.decode(), handler_for(api.kind))
    for method, path, handler in passthrough.ROUTES:
        add_route(app, method, path, handler)
    for path, handler in (
        ("/v1/models", models),
        ("/health", health),
        ("/ready", ready),
        ("/metrics", metrics),
    ):
        add_route(app, "GET", path, handler)
    if config.admin_token:
        add_routes(app, add_route)
    add_route(app, "*", "/{path:.*}", unrouted)  # last: only what no other route takes
    return app
