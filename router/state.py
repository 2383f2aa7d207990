"""What one running router owns (no module-level state)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp

from router.apis.sessions import SessionSources
from router.auth import accepted_key, bearers, tenant
from router.config import RouterConfig, WorkerConfig
from router.fleet.health import HealthProber
from router.fleet.provision import new_worker
from router.fleet.upstream import UpstreamPool
from router.fleet.workers import Worker
from router.kv_events.subscriptions import KvEventSubscriptions
from router.observability.metrics import RouterMetrics
from router.replication.path import SharedPath
from router.routing.attempts import Retry
from router.routing.dispatch import Router
from router.routing.membership import Membership
from router.routing.queue import RequestQueue
from router.routing.response_owners import (
    Continuation,
    ResponseOwners,
    continuation_of,
    holder_of,
)
from router.tokens.keys import PromptKeys

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RouterState:
    config: RouterConfig
    router: Router
    metrics: RouterMetrics
    membership: Membership
    session: aiohttp.ClientSession  # probes, scrapes and discovery
    upstream: UpstreamPool  # requests forwarded to the workers
    queue: RequestQueue
    prober: HealthProber
    # Made once for the request path: where session keys are read, and the header lines
    # that authenticate the router to its engines.
    session_sources: SessionSources = field(init=False)
    upstream_auth: bytes = field(init=False)
    accepted_bearers: tuple[bytes, ...] = field(init=False)  # "Bearer <api key>", if any
    retry: Retry = field(init=False)  # how a request's attempts go on (upstream.*)
    # Read-your-writes across replicas (state.url and state.read_your_writes): set while
    # the shared state runs.
    shared_path: SharedPath | None = None
    # Prompts keyed by the model's own tokens (prefix.tokenizer); None: by text.
    tokens: PromptKeys | None = None
    # Exact mode's subscriptions to the workers' KV events (kv_events); None: none.
    kv_events: KvEventSubscriptions | None = None
    # Which worker stored each Responses response.
    response_owners: ResponseOwners = field(default_factory=ResponseOwners)

    def __post_init__(self) -> None:
        self.retry = Retry.of(self.config.upstream)
        self.session_sources = SessionSources(self.config.session_keys)
        for label in self.session_sources.labels:  # every series from the start
            self.metrics.session_keys.labels(label)
        self.upstream_auth = b"".join(
            b"%s: %s\r\n" % (name.encode(), value.encode())
            for name, value in self.config.upstream.auth_headers.items()
        )
        self.accepted_bearers = bearers(self.config.api_keys)

    async def holder_of(self, response_id: str, tenant: str | None) -> Worker:
        """The worker holding a stored response of ``tenant``'s; ``ResponseNotFound``
        where none does."""
        return await holder_of(
            response_id, tenant, self.response_owners, self.router.fleet, self.shared_path
        )

    async def continuation_of(self, response_id: str, tenant: str | None) -> Continuation:
        """``holder_of``, with the stored conversation's chain where it is known."""
        return await continuation_of(
            response_id, tenant, self.response_owners, self.router.fleet, self.shared_path
        )

    def tenant_of(self, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
        """Whose stored responses a request may reach (``router.auth.tenant``)."""
        if not self.accepted_bearers:
            return None
        return tenant(accepted_key(headers, self.accepted_bearers) or b"")

    def add_worker(self, config: WorkerConfig) -> Worker:
        """The one way a worker joins, from the config file, the admin API or discovery:
        built with its capacity (or its capacity to be read from the engine's /metrics
        by the prober), added to the fleet and the index."""
        worker, known = new_worker(self.config, config)
        self.membership.add(worker)
        if not known:
            self.prober.discover_capacity(worker.name)
        if self.kv_events is not None:
            self.kv_events.reconcile()
        return worker

    def mark_unreachable(self, worker: Worker) -> None:
        """Passive health: a refused connection takes the worker out until a probe passes."""
        if worker.healthy:
            log.warning(
                "worker %s unreachable; out of rotation until its next health probe", worker.name
            )
        worker.healthy = False
