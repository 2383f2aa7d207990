"""The prefix index: which worker is modelled to hold which prefix blocks.

``PrefixIndex`` is the seam: the in-process ``LocalPrefixIndex`` here, a Redis-backed one
later. Each worker has a residency model, an LRU of block hashes sized to the worker's KV
capacity, so a prefix the engine must have evicted is dropped from the index instead of
attracting traffic to a cold cache.

A dispatched request's blocks are *reserved* on its worker at once: ``match`` sees them,
so siblings arriving while its prefill runs find them, but they push nothing out of the
LRU. They are touched (and may evict) only once the worker has computed them, at the
first byte or at the end; a dispatch that fails or is refused releases its reservation
and leaves the model as it was.

A request's blocks are touched tail first, so its head blocks are the most recently
used; eviction then takes a prefix's tail before its head, as vLLM frees blocks. That
keeps each worker's set (nearly) prefix-closed — if block i is held, so are blocks < i —
and the longest match is found by binary search in O(log n) lookups.

A worker whose engine publishes KV events is in *exact* mode: its ``Residency`` gives
way to an ``ExactResidency`` (router.index.exact) that holds what the engine
announced, and request touches become short-lived guesses until the announcement
arrives. Every other worker is *approximate*: the modelled LRU above.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Literal, Protocol

from router.index.events import Event
from router.index.exact import ExactResidency
from router.index.offloaded import ModelledTier, OffloadedBlocks
from router.index.prefix import leading_held

PrefixMode = Literal["exact", "approximate"]
PREFIX_MODES: tuple[PrefixMode, ...] = ("exact", "approximate")
NOTHING: Mapping[int, int] = MappingProxyType({})


class PrefixIndex(Protocol):
    def add_worker(self, worker: str, capacity_blocks: int, offload_blocks: int = 0) -> None:
        """``offload_blocks``: its engine's CPU tier, modelled while it is approximate."""
        ...

    def remove_worker(self, worker: str) -> None: ...

    def resize_worker(self, worker: str, capacity_blocks: int) -> None: ...

    def purge(self, worker: str, started_at: float | None = None) -> None:
        """The worker lost its cache: forget everything it held. ``started_at``: it
        restarted, and this is the engine's process start time (purges for the same
        restart from several replicas then count once)."""
        ...

    def migrate(self, source: str, target: str, taken_at: float | None = None) -> int:
        """Move what ``source`` holds to ``target`` (with ``taken_at``, a checkpoint's
        wall-clock time: only what was touched by then); returns the blocks moved."""
        ...

    def match(self, worker: str, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` the worker holds."""
        ...

    def touch(self, worker: str, hashes: Sequence[int]) -> list[int]:
        """Record that the worker now holds ``hashes``; returns the ones it did not hold."""
        ...

    def reserve(self, worker: str, hashes: Sequence[int]) -> None:
        """A request being computed on the worker will hold ``hashes``: ``match`` counts
        them from now on, the LRU is not touched (local to this replica)."""
        ...

    def release(self, worker: str, hashes: Sequence[int]) -> None:
        """Withdraw one ``reserve`` of ``hashes`` (the request was computed, failed or
        was refused)."""
        ...

    def forget(self, worker: str, hashes: Iterable[int]) -> None:
        """Drop entries that turned out not to be there (e.g. a failed dispatch)."""
        ...

    def resident_blocks(self, worker: str) -> int: ...

    def offloaded_continuation(self, worker: str, hashes: Sequence[int], start: int) -> int:
        """How many of ``hashes`` from ``start`` on (where the worker's ``match`` ends)
        its engine holds in its CPU tier, unbroken: what it would load back rather than
        compute."""
        ...

    def offloaded_blocks(self, worker: str) -> int:
        """Blocks the worker's CPU tier is known to hold."""
        ...

    def prefix_mode(self, worker: str) -> PrefixMode:
        """``exact`` while the worker's residency is what its engine announces."""
        ...

    def size(self) -> int:
        """Entries over all workers."""
        ...


# Touch times (a module attribute, so tests can set the clock).
wall_clock = time.time


class Residency:
    """One worker's modelled KV cache: an LRU of block hashes with a fixed capacity; and,
    with ``offload_blocks``, its engine's CPU tier (``offloaded``)."""

    __slots__ = ("_lru", "capacity_blocks", "evictions", "offloaded")

    def __init__(self, capacity_blocks: int, offload_blocks: int = 0) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self.offloaded = ModelledTier(offload_blocks) if offload_blocks > 0 else None
        # Each entry's value: when it was added (wall clock, as a checkpoint's time is).
        # Held since, it was held at any time after: a migration from a checkpoint moves
        # only what was added by the checkpoint's time.
        self._lru: OrderedDict[int, float] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def longest_prefix(self, hashes: Sequence[int], reserved: Mapping[int, int] = NOTHING) -> int:
        """Leading ``hashes`` held, or reserved (``LocalPrefixIndex.reserve``)."""
        return leading_held(hashes, self._lru, reserved)

    def touch(self, hashes: Sequence[int]) -> list[int]:
        if self.offloaded is not None:
            self.offloaded.touch(hashes)  # written through, as the engine does
        lru = self._lru
        added: list[int] = []
        now = wall_clock()
        # Only the newest capacity_blocks hashes can stay resident anyway.
        for h in reversed(hashes[: self.capacity_blocks]):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = now
                added.append(h)
        overflow = len(lru) - self.capacity_blocks
        for _ in range(max(0, overflow)):
            lru.popitem(last=False)
        self.evictions += max(0, overflow)
        return added

    def forget(self, hashes: Iterable[int]) -> None:
        hashes = list(hashes)
        for h in hashes:
            self._lru.pop(h, None)
        if self.offloaded is not None:
            self.offloaded.forget(hashes)

    def oldest_first(self) -> list[int]:
        return list(self._lru)

    def touched_before(self, when: float) -> list[int]:
        """Entries added at or before ``when`` (held since, so held then), oldest first."""
        return [h for h, added in self._lru.items() if added <= when]

    def restore(self, oldest_first: Iterable[int]) -> None:
        """Add entries from a snapshot, oldest first, below what is already held (as
        added long ago: when is not known)."""
        lru = self._lru
        existing = list(lru.items())
        lru.clear()
        for h in oldest_first:
            lru[h] = 0.0
        for h, touched in existing:
            lru[h] = touched
            lru.move_to_end(h)
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)

    def resize(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        while len(self._lru) > capacity_blocks:
            self._lru.popitem(last=False)
            self.evictions += 1


class WorkerResidency(Protocol):
    """What the index asks of one worker's residency, modelled or announced."""

    capacity_blocks: int

    @property
    def offloaded(self) -> OffloadedBlocks | ModelledTier | None: ...

    def __len__(self) -> int: ...

    def longest_prefix(self, hashes: Sequence[int], reserved: Mapping[int, int]) -> int: ...

    def touch(self, hashes: Sequence[int]) -> list[int]: ...

    def forget(self, hashes: Iterable[int]) -> None: ...

    def oldest_first(self) -> list[int]: ...

    def touched_before(self, when: float) -> list[int]: ...

    def restore(self, oldest_first: Iterable[int]) -> None: ...

    def resize(self, capacity_blocks: int) -> None: ...


class LocalPrefixIndex:
    """The in-process index (one router replica's view)."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerResidency] = {}
        # Per worker, how many dispatched requests reserved each hash.
        self._reserved: dict[str, Counter[int]] = {}
        # Per worker, the CPU tier its modelled residency keeps (blocks; 0: none).
        self._offload_blocks: dict[str, int] = {}

    def add_worker(self, worker: str, capacity_blocks: int, offload_blocks: int = 0) -> None:
        if worker not in self._workers:
            self._workers[worker] = Residency(capacity_blocks, offload_blocks)
            self._offload_blocks[worker] = offload_blocks

    def remove_worker(self, worker: str) -> None:
        self._workers.pop(worker, None)
        self._reserved.pop(worker, None)
        self._offload_blocks.pop(worker, None)

    def resize_worker(self, worker: str, capacity_blocks: int) -> None:
        residency = self._workers.get(worker)
        if residency is not None:
            residency.resize(capacity_blocks)

    def purge(self, worker: str, started_at: float | None = None) -> None:
        residency = self._workers.get(worker)
        if isinstance(residency, ExactResidency):
            self._workers[worker] = ExactResidency(
                residency.capacity_blocks,
                residency.model,
                residency.ttl_s,
                forecast_queue_evictions=residency.forecast_queue_evictions,
                block_tokens=residency.block_tokens,
            )
        elif residency is not None:
            self._workers[worker] = Residency(
                residency.capacity_blocks, self._offload_blocks.get(worker, 0)
            )
        self._reserved.pop(worker, None)

    # -- exact mode ----------------------------------------------------------------------

    def make_exact(
        self,
        worker: str,
        model: str,
        ttl_s: float,
        forecast_queue_evictions: bool = False,
        block_tokens: int | None = None,
    ) -> None:
        """The worker's engine announces its cache from now on; what the model held
        stays as inherited entries until announcements fill the capacity.
        ``forecast_queue_evictions``: ``ExactResidency``'s forecast; ``block_tokens``:
        the router's block size, when the engine's blocks are a multiple of it."""
        residency = self._workers.get(worker)
        if residency is None or isinstance(residency, ExactResidency):
            return
        self._workers[worker] = ExactResidency(
            residency.capacity_blocks,
            model,
            ttl_s,
            residency.oldest_first(),
            forecast_queue_evictions=forecast_queue_evictions,
            block_tokens=block_tokens,
        )

    def make_approximate(self, worker: str) -> None:
        """The worker's announcements stopped: back to the modelled LRU, seeded with
        what was last known."""
        residency = self._workers.get(worker)
        if isinstance(residency, ExactResidency):
            modelled = Residency(residency.capacity_blocks, self._offload_blocks.get(worker, 0))
            modelled.restore(residency.oldest_first())
            self._workers[worker] = modelled

    def apply_events(self, worker: str, rank: int, events: Iterable[Event]) -> bool:
        """Apply a batch the worker's rank announced; False if the worker is not exact."""
        residency = self._workers.get(worker)
        if not isinstance(residency, ExactResidency):
            return False
        residency.apply(rank, events)
        return True

    def clear_rank(self, worker: str, rank: int) -> None:
        """What the rank announced is no longer known (its stream broke, it restarted)."""
        residency = self._workers.get(worker)
        if isinstance(residency, ExactResidency):
            residency.clear_rank(rank)

    def prefix_mode(self, worker: str) -> PrefixMode:
        exact = isinstance(self._workers.get(worker), ExactResidency)
        return "exact" if exact else "approximate"

    def orphan_blocks(self, worker: str) -> int:
        residency = self._workers.get(worker)
        return residency.orphans if isinstance(residency, ExactResidency) else 0

    def migrate(self, source: str, target: str, taken_at: float | None = None) -> int:
        held = self.held_at(source, taken_at)
        if target in self._workers:
            self._workers[target].restore(held)
        self.purge(source)
        return len(held)

    def match(self, worker: str, hashes: Sequence[int]) -> int:
        residency = self._workers.get(worker)
        if residency is None:
            return 0
        return residency.longest_prefix(hashes, self._reserved.get(worker, NOTHING))

    def touch(self, worker: str, hashes: Sequence[int]) -> list[int]:
        residency = self._workers.get(worker)
        return residency.touch(hashes) if residency is not None else []

    def forget(self, worker: str, hashes: Iterable[int]) -> None:
        residency = self._workers.get(worker)
        if residency is not None:
            residency.forget(hashes)

    def reserve(self, worker: str, hashes: Sequence[int]) -> None:
        residency = self._workers.get(worker)
        if residency is not None and hashes:
            self._reserved.setdefault(worker, Counter()).update(hashes)
            if isinstance(residency, ExactResidency):
                residency.dispatched()

    def release(self, worker: str, hashes: Sequence[int]) -> None:
        reserved = self._reserved.get(worker)
        if reserved is None:
            return  # purged or removed since: nothing of it is left
        residency = self._workers.get(worker)
        if isinstance(residency, ExactResidency) and hashes:
            residency.settled()
        for h in hashes:
            left = reserved[h] - 1
            if left > 0:
                reserved[h] = left
            else:
                reserved.pop(h, None)
        if not reserved:
            del self._reserved[worker]

    def reserved_blocks(self, worker: str) -> int:
        """Distinct hashes reserved on the worker (0 when nothing is in flight)."""
        return len(self._reserved.get(worker, ()))

    def resident_blocks(self, worker: str) -> int:
        residency = self._workers.get(worker)
        return len(residency) if residency is not None else 0

    def offloaded_continuation(self, worker: str, hashes: Sequence[int], start: int) -> int:
        residency = self._workers.get(worker)
        if residency is None or not residency.offloaded:
            return 0
        if isinstance(residency, ExactResidency) and residency.windows:
            # A hybrid model's load needs its window groups' chunks too, which the
            # router does not follow in the CPU tier: nothing is credited there.
            return 0
        return residency.offloaded.continuation(hashes, start)

    def offloaded_blocks(self, worker: str) -> int:
        residency = self._workers.get(worker)
        tier = residency.offloaded if residency is not None else None
        return len(tier) if tier is not None else 0

    def offloaded_modelled(self, worker: str) -> bool:
        """The worker is approximate and its CPU tier modelled."""
        residency = self._workers.get(worker)
        return isinstance(residency, Residency) and residency.offloaded is not None

    def offloaded_tier(self, worker: str) -> OffloadedBlocks | None:
        """The worker's CPU tier as its engine announces it (None: not in exact mode)."""
        residency = self._workers.get(worker)
        return residency.offloaded if isinstance(residency, ExactResidency) else None

    def capacity_blocks(self, worker: str) -> int:
        residency = self._workers.get(worker)
        return residency.capacity_blocks if residency is not None else 0

    def workers(self) -> list[str]:
        return list(self._workers)

    def oldest_first(self, worker: str) -> list[int]:
        residency = self._workers.get(worker)
        return residency.oldest_first() if residency is not None else []

    def held_at(self, worker: str, when: float | None = None) -> list[int]:
        """What the worker held at wall-clock ``when`` (None: now), oldest first, as far
        as the index can tell: the entries it has held since then."""
        residency = self._workers.get(worker)
        if residency is None:
            return []
        return residency.oldest_first() if when is None else residency.touched_before(when)

    def restore(self, worker: str, oldest_first: Iterable[int]) -> None:
        residency = self._workers.get(worker)
        if residency is not None:
            residency.restore(oldest_first)

    def size(self) -> int:
        return sum(len(r) for r in self._workers.values())
