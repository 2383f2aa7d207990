"""The router's KV event subscriptions: one ``RankSubscriber`` task per worker and
data-parallel rank, kept in step with the fleet.

Membership is the fleet's (config, admin API, discovery all go through it); this only
follows: every ``interval_s`` (and at once on ``reconcile``) a worker that joined gets
its subscribers, one that left or whose endpoints changed loses them, and a subscriber
that died of a bug is started again. With shared state each replica subscribes on its
own: a PUB socket fans out at no cost to the engine, every replica reads the same
sequenced stream and so agrees, and there is no leader to elect or lose.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import zmq.asyncio

from router.config import KvEventsConfig, KvEventsEndpoints
from router.fleet.workers import Fleet, Worker
from router.index.residency import LocalPrefixIndex
from router.kv_events.metrics import KvEventMetrics
from router.kv_events.subscriber import Exactness, RankEndpoints, RankSubscriber

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0


def rank_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's endpoint for a data-parallel rank: the port plus the rank."""
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint if rank == 0 else f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def worker_endpoints(worker: Worker, config: KvEventsConfig) -> KvEventsEndpoints | None:
    """The worker's own endpoints, else the templates with its host; None: not subscribed."""
    if worker.kv_events is not None:
        return worker.kv_events
    if not config.endpoint:
        return None
    host = worker.origin.host
    if ":" in host:
        host = f"[{host}]"  # an IPv6 address in a tcp:// endpoint
    replay = config.replay_endpoint.format(host=host) if config.replay_endpoint else ""
    return KvEventsEndpoints(config.endpoint.format(host=host), replay)


class KvEventSubscriptions:
    def __init__(
        self,
        fleet: Fleet,
        index: LocalPrefixIndex,
        config: KvEventsConfig,
        block_tokens: int,
        metrics: KvEventMetrics,
    ) -> None:
        self._fleet = fleet
        self._index = index
        self._config = config
        self._exactness = Exactness(
            block_tokens,
            config.speculative_ttl_s,
            config.replay_timeout_s,
            config.forecast_queue_evictions,
        )
        self._metrics = metrics
        self._context = zmq.asyncio.Context()
        self._running: dict[str, tuple[KvEventsEndpoints, list[asyncio.Task[None]]]] = {}
        self._subscribers: dict[str, list[RankSubscriber]] = {}

    def subscribed(self) -> list[str]:
        return list(self._running)

    def status(self, worker: str) -> dict[str, Any] | None:
        """What the admin API shows of a worker's subscription (None: not subscribed)."""
        running = self._running.get(worker)
        if running is None:
            return None
        ends = running[0]
        return {
            "endpoint": ends.endpoint,
            "replay_endpoint": ends.replay_endpoint or None,
            "ranks": [
                {"rank": s.rank, "next_seq": s.next_seq, "rejected": s.rejected}
                for s in self._subscribers.get(worker, ())
            ],
        }

    def reconcile(self) -> None:
        wanted = {
            w.name: (w, ends)
            for w in self._fleet.all()
            if (ends := worker_endpoints(w, self._config)) is not None
        }
        for name, (ends, tasks) in list(self._running.items()):
            if name not in wanted or wanted[name][1] != ends:
                self._stop(name, tasks)
            elif any(t.done() for t in tasks):
                self._stop(name, tasks)  # a subscriber died of a bug: start afresh
        for name, (worker, ends) in wanted.items():
            if name not in self._running:
                self._start(worker, ends)

    async def run(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        while True:
            self.reconcile()
            await asyncio.sleep(interval_s)

    async def aclose(self) -> None:
        tasks = [t for _, running in self._running.values() for t in running]
        for name, (_, running) in list(self._running.items()):
            self._stop(name, running)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._context.destroy(linger=0)

    def _start(self, worker: Worker, ends: KvEventsEndpoints) -> None:
        topic = self._config.topic.encode()
        tasks: list[asyncio.Task[None]] = []
        subscribers = self._subscribers[worker.name] = []
        for rank in range(self._config.data_parallel_size):
            replay = rank_endpoint(ends.replay_endpoint, rank) if ends.replay_endpoint else None
            endpoints = RankEndpoints(rank, rank_endpoint(ends.endpoint, rank), replay, topic)
            subscriber = RankSubscriber(
                self._context, worker, endpoints, self._index, self._exactness, self._metrics
            )
            subscribers.append(subscriber)
            task = asyncio.create_task(subscriber.run(), name=f"kvrouter-kv-events-{worker.name}")
            task.add_done_callback(self._log_death)
            tasks.append(task)
        self._metrics.worker_added(worker.name)
        self._running[worker.name] = (ends, tasks)
        log.info("worker %s: subscribed to KV events at %s", worker.name, ends.endpoint)

    def _stop(self, name: str, tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            task.cancel()
        del self._running[name]
        self._subscribers.pop(name, None)
        self._metrics.worker_removed(name)
        self._index.make_approximate(name)

    @staticmethod
    def _log_death(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s died", task.get_name(), exc_info=task.exception())
