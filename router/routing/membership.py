"""Which workers the router routes to, and what a worker joining, leaving, moving or
restarting does to the router's state: the fleet, the prefix index, the metrics' series
and what the learner knows of it. Free of I/O.

Every change of membership goes through here: a worker from the config file, the admin
API, discovery or a sibling process joins through ``RouterState.add_worker`` (which
builds it and has the prober read its capacity when nothing else gives it) and then
``Membership.add``; the others call ``remove``, ``migrate`` and ``worker_restarted``.
"""

from __future__ import annotations

from router.fleet.workers import Fleet, Worker
from router.index.residency import PrefixIndex
from router.observability.metrics import RouterMetrics
from router.routing.learning import Learner


class Membership:
    def __init__(
        self,
        fleet: Fleet,
        index: PrefixIndex,
        metrics: RouterMetrics,
        learner: Learner,
        block_tokens: int,
    ) -> None:
        self.fleet = fleet
        self._index = index
        self._metrics = metrics
        self._learner = learner
        self._block_tokens = block_tokens

    def add(self, worker: Worker) -> None:
        self.fleet.add(worker)
        self._metrics.worker_added(worker.name)
        self._index.add_worker(
            worker.name,
            max(1, worker.capacity_tokens // self._block_tokens),
            worker.offload_tokens // self._block_tokens,
        )

    def remove(self, name: str) -> None:
        self.fleet.remove(name)
        self._metrics.worker_removed(name)
        self._index.remove_worker(name)
        self._learner.forget(name)

    def migrate(self, source: str, target: str, taken_at: float | None = None) -> int:
        """``source``'s KV state now lives on ``target`` (checkpointed and restored): its
        index entries move there, below what ``target`` holds already and within its
        capacity, and its sessions are remembered there, so their next turns hit on
        ``target`` and are judged against it. Returns the number of blocks moved. With
        ``taken_at`` (the checkpoint's wall-clock time), only what the source held by
        then moves: what it computed after, the restored engine lacks."""
        moved = self._index.migrate(source, target, taken_at)
        self._learner.migrate(source, target, self.fleet.workers[target].epoch)
        return moved

    def worker_restarted(self, worker: Worker) -> None:
        """The engine restarted: its cache is gone, so is everything the index says of it."""
        self._index.purge(worker.name, worker.engine_started_at)
        self._learner.forget(worker.name)
        worker.epoch += 1
        self._metrics.worker_restarts.labels(worker.name).inc()
