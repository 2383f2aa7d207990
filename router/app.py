"""The router as a whole: its state, running (``running_state``), and the routes it
serves (``routes_for``); ``router.server`` puts both on a socket.

Each resource is owned by one context: the upstream pools and client session, the
router state, then its background tasks. Only what started is cleaned up.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import cast

import aiohttp

from router.apis.table import APIS
from router.config import ENGINE_TOKENIZER, RouterConfig
from router.discovery import reconciler as discovery
from router.edge import admin, ops, passthrough
from router.edge.relay import serve
from router.edge.routes import Guard, Handler, Routes
from router.fleet.health import HealthProber
from router.fleet.upstream import UpstreamPool
from router.fleet.workers import Fleet
from router.index.residency import LocalPrefixIndex, PrefixIndex
from router.kv_events.metrics import KvEventMetrics
from router.kv_events.subscriptions import KvEventSubscriptions
from router.observability.metrics import RouterMetrics
from router.observability.offload_metrics import OffloadCollector
from router.observability.queue_metrics import QueueMetrics
from router.planning.reload import reload_tokens_per_s
from router.replication.connect import connect
from router.replication.index import SharedPrefixIndex
from router.replication.metrics import PathMetrics, RedisMetrics
from router.replication.path import SharedPath
from router.replication.sync import RedisSync
from router.routing.dispatch import Router
from router.routing.membership import Membership
from router.routing.policy_slot import PolicySlot
from router.routing.queue import RequestQueue
from router.state import RouterState
from router.tokens.conversation import ContentFormat
from router.tokens.engine import EngineTokens
from router.tokens.keys import PromptKeys, TokenKeys, TokenMetrics
from router.tokens.model import ModelTokenizer
from router.wire.kinds import Kind

log = logging.getLogger(__name__)

# On shutdown, how long the last index changes may take to reach Redis.
FINAL_FLUSH_TIMEOUT_S = 2.0
SYNC_STOP_TIMEOUT_S = 5.0


def build_state(
    config: RouterConfig, session: aiohttp.ClientSession, upstream: UpstreamPool
) -> RouterState:
    """The router state, complete: its prober knows the workers whose capacity must be
    read from the engine (nothing is set on the state later)."""
    block_tokens = config.prefix.block_tokens
    fleet, local = Fleet(), LocalPrefixIndex()
    index: PrefixIndex = SharedPrefixIndex(local) if config.state.url else local
    metrics = RouterMetrics(fleet, index, block_tokens)
    reload_rate = reload_tokens_per_s(config.offload, config.capacity)
    metrics.registry.register(OffloadCollector(fleet, local, block_tokens, reload_rate))
    policies = PolicySlot(config.policy, config.policy_knobs, config.seed, metrics)
    router = Router(
        fleet,
        index,
        policies,
        block_tokens,
        metrics,
        config.health.stale_after_s,
        config.log_requests,
        reload_rate,
    )
    queue_metrics = QueueMetrics(metrics.registry)
    queue = RequestQueue(
        config.admission, fleet, router.learner.prefill_tokens_per_s, queue_metrics
    )
    queue_metrics.watch(queue)
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
    state = RouterState(config, router, metrics, membership, session, upstream, queue, prober)
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
    redis_metrics = RedisMetrics(state.metrics.registry)
    sync = RedisSync(
        handle.client,
        index,
        router.fleet,
        router.learner.prefill_rate,
        router.policies,
        state.config.state,
        redis_metrics,
        state.queue,
    )
    await sync.start()
    task = asyncio.create_task(sync.run(), name="kvrouter-redis-sync")
    state.router.policies.publisher = sync.publish_policy
    state.queue.publisher = sync.publish_admission
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
            redis_metrics.bad_entries,
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
        state.queue.publisher = None
        sync.stop()
        try:
            await asyncio.wait_for(task, SYNC_STOP_TIMEOUT_S)
        except TimeoutError:
            log.warning("redis sync did not stop in %.0f s", SYNC_STOP_TIMEOUT_S)
        await sync.flush(timeout_s=FINAL_FLUSH_TIMEOUT_S)
        await handle.aclose()


@contextlib.asynccontextmanager
async def running_state(config: RouterConfig) -> AsyncIterator[RouterState]:
    """The router's state, its background tasks running: the health prober, discovery,
    KV event subscriptions and the shared state's sync; each stopped on exit, only what
    started."""
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
                yield state
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task


def routes_for(config: RouterConfig) -> Routes:
    """Every route the router serves, each with the credential it needs."""
    routes = Routes()
    for api in APIS.values():
        routes.add("POST", api.path.decode(), relay_for(api.kind), Guard.CLIENT)
    for method, path, handler in passthrough.ROUTES:
        routes.add(method, path, handler, Guard.CLIENT)
    routes.add("GET", "/v1/models", ops.models, Guard.CLIENT)
    routes.add("GET", "/health", ops.health, Guard.OPEN)
    routes.add("GET", "/ready", ops.ready, Guard.OPEN)
    routes.add("GET", "/metrics", ops.metrics, Guard.METRICS)
    if config.admin_token:
        for method, path, handler in admin.ROUTES:
            routes.add(method, path, handler, Guard.ADMIN)
    return routes


def relay_for(kind: Kind) -> Handler:
    """The handler of a keyed route: the prefix-aware proxy (``router.edge.relay.serve``)."""
    return functools.partial(serve, kind)
