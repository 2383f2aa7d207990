"""A worker's KV cache as its engine announces it: exact mode's residency.

The engine's events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) are the
truth, named with the router's own hashes (``EngineChains``, one per data-parallel
rank: each rank is an engine with a cache and a publisher of its own). Two layers sit
beside them, both only ever shrinking the gap between what the router has heard and
what the engine holds:

* *speculative* entries: blocks a request computed on the worker (``touch``, at its first
  byte and its end), held for ``ttl_s`` or until the engine's announcement arrives. The
  events of a step reach the router after the step; a sibling arriving in between must
  still find the prompt. An entry the engine never announces (a reply the engine
  tokenized differently) lapses.
* *inherited* entries: what the modelled LRU held when the worker turned exact, for
  blocks the engine stored before the router subscribed. Nothing announced can name
  them, so they go oldest first as announced blocks fill the worker's capacity, as the
  engine's LRU would push them out.

A router hash held by any rank counts as held by the worker: the router chooses the
engine, the engine its rank.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence

from router.clock import monotonic
from router.kv_events.chain import EngineChains
from router.kv_events.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event
from router.prefix import leading_held

# Engine names kept per rank, beyond the worker's capacity: room for removals missed.
NAMES_PER_CAPACITY_BLOCK = 2
MIN_NAMES = 1024


class ExactResidency:
    __slots__ = (
        "_chains",
        "_clock",
        "_held",
        "_inherited",
        "_speculative",
        "capacity_blocks",
        "evictions",
        "model",
        "ttl_s",
    )

    def __init__(
        self,
        capacity_blocks: int,
        model: str,
        ttl_s: float,
        inherited: Iterable[int] = (),
        clock: Callable[[], float] = monotonic,
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self.model = model
        self.ttl_s = ttl_s
        self.evictions = 0  # blocks the engine announced removed
        self._clock = clock
        self._chains: dict[int, EngineChains] = {}
        self._held: Counter[int] = Counter()  # router hash -> ranks holding it
        self._inherited: OrderedDict[int, None] = OrderedDict.fromkeys(inherited)
        # Expiry times, oldest first: every entry gets the same ttl from its touch.
        self._speculative: OrderedDict[int, float] = OrderedDict()
        self._trim_inherited()

    # -- what the engine announces ----------------------------------------------------

    def apply(self, rank: int, events: Iterable[Event]) -> None:
        removed: list[BlockHash] = []  # consecutive removals, applied together
        for event in events:
            if isinstance(event, BlockRemoved):
                removed += event.block_hashes
                continue
            if removed:
                self._removed(rank, removed)
                removed = []
            if isinstance(event, BlockStored):
                added, dropped = self._chain(rank).stored(event)
                self._hold(added)
                self._release(dropped)
            elif isinstance(event, AllBlocksCleared):
                self.clear_rank(rank)
        if removed:
            self._removed(rank, removed)
        self._trim_inherited()

    def _removed(self, rank: int, engine_hashes: Sequence[BlockHash]) -> None:
        gone = self._chain(rank).removed(engine_hashes)
        self.evictions += len(gone)
        self._release(gone)

    def clear_rank(self, rank: int) -> None:
        """The rank's cache is empty (cleared, restarted, or its stream broke): what it
        alone held goes, and with it whatever the router had not heard announced."""
        chains = self._chains.pop(rank, None)
        if chains is not None:
            self._release(chains.clear())
        self._inherited.clear()
        self._speculative.clear()

    @property
    def orphans(self) -> int:
        """Announced blocks skipped because their parent was never announced."""
        return sum(c.orphans for c in self._chains.values())

    def _chain(self, rank: int) -> EngineChains:
        chains = self._chains.get(rank)
        if chains is None:
            bound = max(MIN_NAMES, NAMES_PER_CAPACITY_BLOCK * self.capacity_blocks)
            chains = self._chains[rank] = EngineChains(self.model, bound)
        return chains

    def _hold(self, router_hashes: Iterable[int]) -> None:
        held, speculative, inherited = self._held, self._speculative, self._inherited
        for h in router_hashes:
            held[h] = held.get(h, 0) + 1
            speculative.pop(h, None)
            inherited.pop(h, None)

    def _release(self, router_hashes: Iterable[int]) -> None:
        held = self._held
        for h in router_hashes:
            left = held[h] - 1
            if left > 0:
                held[h] = left
            else:
                held.pop(h, None)

    def _trim_inherited(self) -> None:
        inherited = self._inherited
        while inherited and len(self._held) + len(inherited) > self.capacity_blocks:
            inherited.popitem(last=False)

    # -- the residency interface the index uses -----------------------------------------

    def __len__(self) -> int:
        return len(self._held) + len(self._inherited)

    def __contains__(self, block_hash: object) -> bool:
        if block_hash in self._held or block_hash in self._inherited:
            return True
        if not isinstance(block_hash, int):
            return False
        expiry = self._speculative.get(block_hash)
        return expiry is not None and expiry > self._clock()

    def longest_prefix(self, hashes: Sequence[int], reserved: Mapping[int, int]) -> int:
        """Leading ``hashes`` held, announced or not yet, or reserved."""
        return leading_held(hashes, self, reserved)

    def touch(self, hashes: Sequence[int]) -> list[int]:
        """A request computed ``hashes`` here: speculative until the engine says so."""
        self._expire()
        speculative, held = self._speculative, self._held
        expiry = self._clock() + self.ttl_s
        added: list[int] = []
        for h in reversed(hashes[: self.capacity_blocks]):
            if h in held:
                continue
            if h in speculative:
                speculative.move_to_end(h)
            elif h not in self._inherited:
                added.append(h)
            speculative[h] = expiry
        while len(speculative) > self.capacity_blocks:
            speculative.popitem(last=False)
        return added

    def _expire(self) -> None:
        speculative, now = self._speculative, self._clock()
        while speculative:
            oldest = next(iter(speculative.values()))
            if oldest > now:
                break
            speculative.popitem(last=False)

    def forget(self, hashes: Iterable[int]) -> None:
        """Drop guesses that turned out wrong; what the engine announced stays."""
        for h in hashes:
            self._speculative.pop(h, None)
            self._inherited.pop(h, None)

    def oldest_first(self) -> list[int]:
        return [*self._inherited, *(h for h in self._held if h not in self._inherited)]

    def restore(self, oldest_first: Iterable[int]) -> None:
        """Entries from a snapshot or a migration: inherited, below what is there."""
        existing = list(self._inherited)
        self._inherited = OrderedDict.fromkeys(h for h in oldest_first if h not in self._held)
        for h in existing:
            self._inherited[h] = None
            self._inherited.move_to_end(h)
        self._trim_inherited()

    def resize(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self._trim_inherited()
