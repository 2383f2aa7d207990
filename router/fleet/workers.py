"""Workers as the router tracks them: address, health, models and load.

Load accounting is exact: a ``Lease`` is taken before dispatch and released exactly once
on every exit path (success, upstream error, client disconnect, timeout); releasing twice
is a no-op. Broken accounting is what makes cache-aware routers collapse onto one worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from policies.base import Outcome
from router.clock import monotonic
from router.config import KvEventsEndpoints
from router.fleet.breaker import CircuitBreaker
from router.fleet.demand import RecentDemand
from router.fleet.upstream import Origin


@dataclass(slots=True)
class Worker:
    name: str
    url: str
    capacity_tokens: int
    healthy: bool = True
    draining: bool = False  # no new requests; in-flight ones finish
    models: frozenset[str] = frozenset()
    # The model the engine serves as itself (not a LoRA adapter): what its KV events'
    # blocks are keyed by (/v1/models' card without a parent).
    base_model: str | None = None
    kv_events: KvEventsEndpoints | None = None  # this worker's own, over the templates
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    queued_prefill_tokens: int = 0
    # Load other router replicas report on this worker (shared state; 0 when alone).
    remote_requests: int = 0
    remote_tokens: int = 0
    remote_queued_prefill: int = 0
    # The engine's process_start_time_seconds when last seen; a change means a restart.
    engine_started_at: float | None = None
    epoch: int = 0  # restarts seen; a session remembered on an older epoch lost its cache
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    # What the engine's /metrics said, and when (monotonic); None: never read.
    engine_running: int = 0
    engine_waiting: int = 0
    engine_kv_usage: float = 0.0
    metrics_at: float | None = None
    # Prompt tokens the engine says it read from an offload tier (host memory or disk)
    # since it started: a tier is there whether or not it announces its blocks.
    engine_offload_hits: float = 0.0
    # Its engine's CPU tier in tokens, modelled while approximate (0: none).
    offload_tokens: int = 0
    # The engine's KV block size in tokens (its cache_config_info or KV events); None:
    # not reported. The engine caches whole blocks of it (router.index.engine_blocks).
    engine_block_tokens: int | None = None
    demand: RecentDemand = field(default_factory=RecentDemand)  # prompt tokens sent lately
    # The same from the other replicas, as they last shared it (fading from then on).
    remote_demand: RecentDemand = field(default_factory=RecentDemand)
    origin: Origin = field(init=False)  # the URL, parsed once for the upstream client
    # The first-byte bounds of the attempts sent to it that it has not begun to answer.
    unanswered: set[asyncio.Timeout] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.origin = Origin.of(self.url)

    def abandon_unanswered(self) -> None:
        """The worker failed its health probe: the requests it has not begun to answer
        are given up on now, so that their attempts fail over to another worker, and not
        when their timeouts run out (a whole reply's is ``read_timeout_s``, longer than
        the retry deadline)."""
        if self.unanswered:
            now = asyncio.get_running_loop().time()
            for bound in self.unanswered:
                bound.reschedule(now)

    def saturated(self, now: float, stale_after_s: float) -> bool:
        """Metrics missing or stale: assume the worst."""
        return self.metrics_at is None or now - self.metrics_at > stale_after_s

    def takes_requests(self) -> bool:
        """Healthy, not draining, and its circuit lets a request through."""
        return self.healthy and not self.draining and self.breaker.allows()

    def serves(self, model: str | None) -> bool:
        # Before the first /v1/models answer a worker is assumed to serve any model.
        return model is None or not self.models or model in self.models

    @property
    def load(self) -> int:
        """Requests on the worker: those this router and its replicas sent, or what the
        engine itself reports running and waiting, whichever is more (traffic from
        elsewhere counts too). The one measure of load every choice uses."""
        return max(
            self.outstanding_requests + self.remote_requests,
            self.engine_running + self.engine_waiting,
        )


# The metric label of requests for a model no worker lists.
OTHER_MODEL = "other"


class Lease:
    """One request's share of a worker's load, and its ticket with the worker's circuit
    breaker (``end`` settles both)."""

    __slots__ = ("_prefill_open", "_released", "prefill_tokens", "ticket", "tokens", "worker")

    def __init__(self, worker: Worker, tokens: int, prefill_tokens: int) -> None:
        self.worker = worker
        self.tokens = tokens
        self.prefill_tokens = prefill_tokens
        self._released = False
        self._prefill_open = True
        # Which opening of the worker's circuit this request was sent after.
        self.ticket = worker.breaker.on_dispatch()
        worker.outstanding_requests += 1
        worker.outstanding_tokens += tokens
        worker.queued_prefill_tokens += prefill_tokens

    def prefill_done(self) -> None:
        """The first byte arrived: this request's prefill is no longer queued work."""
        if self._prefill_open:
            self._prefill_open = False
            self.worker.queued_prefill_tokens -= self.prefill_tokens

    def release(self) -> None:
        if self._released:
            return
        self.prefill_done()
        self._released = True
        self.worker.outstanding_requests -= 1
        self.worker.outstanding_tokens -= self.tokens

    def end(self, outcome: Outcome) -> None:
        """The request ended as ``outcome``: released, and the breaker told, once."""
        if not self._released:
            self.release()
            self.worker.breaker.on_outcome(self.ticket, outcome)

    @property
    def released(self) -> bool:
        return self._released


@dataclass(slots=True)
class Fleet:
    """The workers this router routes to, by name."""

    workers: dict[str, Worker] = field(default_factory=dict)
    _models: frozenset[str] | None = None  # every worker's models, kept until one changes

    def add(self, worker: Worker) -> None:
        self.workers[worker.name] = worker
        self._models = None

    def remove(self, name: str) -> None:
        self.workers.pop(name, None)
        self._models = None

    def set_models(self, worker: Worker, models: frozenset[str]) -> None:
        """What the worker's /v1/models listed (the one way a worker's models change)."""
        if models != worker.models:
            worker.models = models
            self._models = None

    def all(self) -> list[Worker]:
        return list(self.workers.values())

    def eligible(
        self, model: str | None, exclude: Iterable[str] = (), stale_after_s: float | None = None
    ) -> list[Worker]:
        """Healthy workers serving ``model`` (None: any) whose circuit lets a request
        through; with
        ``stale_after_s``, workers with stale engine metrics only if all are stale."""
        excluded = set(exclude)
        found = [
            w
            for w in self.workers.values()
            if w.name not in excluded and w.serves(model) and w.takes_requests()
        ]
        if stale_after_s is None:
            return found
        now = monotonic()
        fresh = [w for w in found if not w.saturated(now, stale_after_s)]
        return fresh or found

    def models(self) -> frozenset[str]:
        if self._models is None:
            self._models = frozenset(m for w in self.workers.values() for m in w.models)
        return self._models

    def serves(self, model: str) -> bool:
        """Some worker lists ``model``; before any worker's list is known (a /v1/models
        the router may not read, say), any model is passed on."""
        known = self.models()
        return model in known if known else True

    def model_label(self, model: str) -> str:
        """``model`` as a metric label: only names some worker lists, so a client cannot
        grow the router's series with names of its own."""
        return model if model in self.models() else OTHER_MODEL
