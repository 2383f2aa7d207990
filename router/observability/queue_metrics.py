"""The router's queue in ``/metrics``: how many requests it holds and for which workers,
how long the admitted ones waited, and the ones it let go and why (``router.routing.queue``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, Protocol, get_args

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.config import PRIORITIES
from router.observability.metric_types import LoopCounter, LoopHistogram

# Why the router's queue let a request go (router.routing.queue).
ShedReason = Literal["deadline", "ttft_target", "queue_full", "queue_bytes", "displaced"]
SHED_REASONS: tuple[ShedReason, ...] = get_args(ShedReason)
# Why a request was held rather than sent at once: its worker's queued prefill, its KV
# budget or request ceiling (the room rules), requests already held for that worker,
# or the door (a new session while sessions under way wait).
HoldReason = Literal["prefill", "kv", "ceiling", "behind", "door"]
HOLD_REASONS: tuple[HoldReason, ...] = get_args(HoldReason)
# Waits at the router: from none (most requests, when there is room) up to the batch
# class's default deadline.
QUEUE_WAIT_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)


class HeldRequests(Protocol):
    held_prefill: dict[str, int]
    held_bytes: int

    def depth(self, priority: str | None = None) -> int: ...

    def held_for(self, worker: str) -> int: ...


class _QueueCollector(Collector):
    def __init__(self, queue: HeldRequests) -> None:
        self._queue = queue

    def collect(self) -> Iterator[GaugeMetricFamily]:
        queue = self._queue
        depth = GaugeMetricFamily(
            "kvrouter_queue_depth",
            "Requests held in the router's queue, by class.",
            labels=["priority"],
        )
        for priority in PRIORITIES:
            depth.add_metric([priority], queue.depth(priority))
        yield depth
        per_worker = GaugeMetricFamily(
            "kvrouter_queue_held_requests",
            "Requests held for each worker (workers holding none are left out).",
            labels=["worker"],
        )
        prefill = GaugeMetricFamily(
            "kvrouter_queue_held_prefill_tokens",
            "Uncached prompt tokens held for each worker: its queue at the router.",
            labels=["worker"],
        )
        for worker, tokens in sorted(queue.held_prefill.items()):
            per_worker.add_metric([worker], queue.held_for(worker))
            prefill.add_metric([worker], tokens)
        yield per_worker
        yield prefill
        yield GaugeMetricFamily(
            "kvrouter_queue_held_bytes", "Bytes of request bodies held.", value=queue.held_bytes
        )


class QueueMetrics:
    """The queue's observer (``router.routing.queue.QueueObserver``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self.wait = LoopHistogram(
            "kvrouter_queue_wait_seconds",
            "Time requests waited in the router's queue before going to a worker, by "
            "class (requests that went at once: 0).",
            ["priority"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=registry,
        )
        self.sheds = LoopCounter(
            "kvrouter_queue_sheds",
            "Requests the queue let go before any engine saw them (429, Anthropic 529), "
            "by class and why: deadline, ttft_target (could no longer start in time for "
            "the first-token target), queue_full, queue_bytes, displaced (by a request "
            "of a higher class).",
            ["priority", "reason"],
            registry=registry,
        )
        self.held_total = LoopCounter(
            "kvrouter_queue_held",
            "Requests held rather than sent at once, by class and why: prefill (the "
            "worker's queued prefill), kv (its KV budget), ceiling (its request ceiling), "
            "behind (others held for it), door (a new session while sessions under way "
            "wait).",
            ["priority", "reason"],
            registry=registry,
        )
        self.abandoned_total = LoopCounter(
            "kvrouter_queue_abandoned",
            "Held requests whose client left before they went to a worker.",
            ["priority"],
            registry=registry,
        )
        self.moved = LoopCounter(
            "kvrouter_queue_moved",
            "Held requests that went to another worker than the one first chosen (it "
            "had room first and the policy preferred it to the wait).",
            [],
            registry=registry,
        )
        self._waits = {p: self.wait.labels(p) for p in PRIORITIES}
        self._sheds = {(p, r): self.sheds.labels(p, r) for p in PRIORITIES for r in SHED_REASONS}
        self._abandoned = {p: self.abandoned_total.labels(p) for p in PRIORITIES}
        self._held = {
            (p, r): self.held_total.labels(p, r) for p in PRIORITIES for r in HOLD_REASONS
        }
        self._moved = self.moved.labels()

    def watch(self, queue: HeldRequests) -> None:
        """Report ``queue``'s depth and what it holds at each scrape."""
        self._registry.register(_QueueCollector(queue))

    def admitted(self, priority: str, waited_s: float, moved: bool) -> None:
        self._waits[priority].observe(waited_s)
        if moved:
            self._moved.inc()

    def shed(self, priority: str, reason: ShedReason) -> None:
        self._sheds[(priority, reason)].inc()

    def held(self, priority: str, reason: HoldReason) -> None:
        self._held[(priority, reason)].inc()

    def abandoned(self, priority: str) -> None:
        self._abandoned[priority].inc()
