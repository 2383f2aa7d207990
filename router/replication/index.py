"""``SharedPrefixIndex``: the local index, with every change also sent to the other replicas.

Reads never leave the process (the hot path makes no Redis round trip); writes apply
locally at once and are queued for the publisher (``router.replication.sync``), which batches
them onto Redis. Changes from other replicas arrive through ``apply``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from router.index.residency import LocalPrefixIndex, PrefixMode
from router.replication.events import IndexEvent
from router.replication.outbox import Outbox


class SharedPrefixIndex:
    def __init__(self, local: LocalPrefixIndex, outbox: Outbox | None = None) -> None:
        self.local = local
        self.outbox = outbox if outbox is not None else Outbox()
        # Per worker, the engine start time of the last restart purged here (by this
        # replica or on another's word): each replica that notices a restart sends its
        # purge, and only the first may wipe what the others added since.
        self._restarts: dict[str, float] = {}

    # -- reads: local only --------------------------------------------------------------

    def match(self, worker: str, hashes: Sequence[int]) -> int:
        return self.local.match(worker, hashes)

    def offloaded_continuation(self, worker: str, hashes: Sequence[int], start: int) -> int:
        # Local: every replica hears the engines' CPU tiers itself, as their GPUs.
        return self.local.offloaded_continuation(worker, hashes, start)

    def offloaded_blocks(self, worker: str) -> int:
        return self.local.offloaded_blocks(worker)

    def resident_blocks(self, worker: str) -> int:
        return self.local.resident_blocks(worker)

    def prefix_mode(self, worker: str) -> PrefixMode:
        # Every replica subscribes to the engines' events itself (router.kv_events).
        return self.local.prefix_mode(worker)

    def size(self) -> int:
        return self.local.size()

    # -- writes: local, then shared -----------------------------------------------------

    def add_worker(self, worker: str, capacity_blocks: int, offload_blocks: int = 0) -> None:
        self.local.add_worker(worker, capacity_blocks, offload_blocks)

    def remove_worker(self, worker: str) -> None:
        self.local.remove_worker(worker)
        self._restarts.pop(worker, None)

    def resize_worker(self, worker: str, capacity_blocks: int) -> None:
        self.local.resize_worker(worker, capacity_blocks)

    def purge(self, worker: str, started_at: float | None = None) -> None:
        if not self._first_purge(worker, started_at):
            return
        self.local.purge(worker)
        self.outbox.append(IndexEvent("purge", worker, (), started_at))

    def migrate(self, source: str, target: str, taken_at: float | None = None) -> int:
        local = self.local
        held = local.held_at(source, taken_at)
        moved = local.migrate(source, target, taken_at)
        # Oldest first as separate touches would make each the newest in turn; one event
        # with the newest first (the order a prefix is touched in) keeps the LRU order.
        if held:
            self.outbox.append(IndexEvent("touch", target, tuple(reversed(held))))
        self.outbox.append(IndexEvent("purge", source, ()))
        return moved

    def touch(self, worker: str, hashes: Sequence[int]) -> list[int]:
        added = self.local.touch(worker, hashes)
        if hashes:
            self.outbox.append(IndexEvent("touch", worker, tuple(hashes)))
        return added

    def reserve(self, worker: str, hashes: Sequence[int]) -> None:
        # Not sent: other replicas learn the blocks when they are computed (``touch``).
        self.local.reserve(worker, hashes)

    def release(self, worker: str, hashes: Sequence[int]) -> None:
        self.local.release(worker, hashes)

    def forget(self, worker: str, hashes: Iterable[int]) -> None:
        hashes = tuple(hashes)
        self.local.forget(worker, hashes)
        if hashes:
            self.outbox.append(IndexEvent("forget", worker, hashes))

    # -- from other replicas --------------------------------------------------------------

    def apply(self, event: IndexEvent) -> None:
        if event.op == "touch":
            self.local.touch(event.worker, event.hashes)
        elif event.op == "forget":
            self.local.forget(event.worker, event.hashes)
        elif self._first_purge(event.worker, event.started):
            self.local.purge(event.worker)

    def _first_purge(self, worker: str, started_at: float | None) -> bool:
        """A purge for this engine start is new here (one with no start time always is)."""
        if started_at is None:
            return True
        if started_at <= self._restarts.get(worker, float("-inf")):
            return False
        self._restarts[worker] = started_at
        return True
