"""What one router app owns, on a typed ``web.AppKey`` (no module-level state)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from router.admission import Admission
from router.config import RouterConfig, WorkerConfig
from router.health import HealthProber
from router.membership import Membership
from router.metrics import RouterMetrics
from router.provision import new_worker
from router.routing import Router
from router.upstream import UpstreamPool
from router.workers import Worker

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RouterState:
    config: RouterConfig
    router: Router
    metrics: RouterMetrics
    membership: Membership
    session: aiohttp.ClientSession  # probes, scrapes and discovery
    upstream: UpstreamPool  # requests forwarded to the workers
    admission: Admission
    prober: HealthProber

    def add_worker(self, config: WorkerConfig) -> Worker:
        """The one way a worker joins, from the config file, the admin API or discovery:
        built with its capacity (or its capacity to be read from the engine's /metrics
        by the prober), added to the fleet and the index."""
        worker, known = new_worker(self.config, config)
        self.membership.add(worker)
        if not known:
            self.prober.discover_capacity(worker.name)
        return worker

    def mark_unreachable(self, worker: Worker) -> None:
        """Passive health: a refused connection takes the worker out until a probe passes."""
        if worker.healthy:
            log.warning(
                "worker %s unreachable; out of rotation until its next health probe", worker.name
            )
        worker.healthy = False


STATE_KEY = web.AppKey("kvrouter_state", RouterState)
