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

What the engine holds now is not what it will hold when it schedules the request being
routed: the requests dispatched to it before, still queued or prefilling, will allocate
blocks for what they did not find cached, and allocation evicts from the head of the
engine's free queue. With ``forecast_queue_evictions`` the residency keeps the free
queue's order as vLLM keeps it (a block goes to the tail when the request using it ends,
last block first; a touch at the first byte and at the end stands for that) and counts
the requests dispatched and not yet computed (``dispatched``/``settled``); their blocks
are the index's reservation (in use, or about to be). The reserved blocks the engine has
not announced, and a partial last block each, are the *demand*; whatever of it the free
room does not cover comes off the head of the queue, reserved blocks skipped, and
``longest_prefix`` stops at the first block so *doomed*.
Recency only grows toward a chain's head (each release takes a block with all its
ancestors, tail first), so the doomed blocks of a prefix are a suffix of it and a binary
search finds where they start.

A router hash held by any rank counts as held by the worker: the router chooses the
engine, the engine its rank.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import count

from router.clock import monotonic
from router.index.chains import EngineChains
from router.index.events import BlockHash, BlockRemoved, BlockStored, Event
from router.index.offloaded import OffloadedBlocks
from router.index.prefix import leading_held
from router.index.windows import WindowGroups

# Engine names kept per rank, beyond the worker's capacity: room for removals missed.
NAMES_PER_CAPACITY_BLOCK = 2
MIN_NAMES = 1024
# The same for the CPU tier, whose size the router is not told: a tier over four times
# the GPU's capacity is under-counted (its oldest names dropped), never over-counted.
OFFLOADED_NAMES_PER_CAPACITY_BLOCK = 8


class ExactResidency:
    __slots__ = (
        "_chains",
        "_clock",
        "_dispatched",
        "_doomed_after",
        "_held",
        "_inherited",
        "_recency",
        "_speculative",
        "_ticks",
        "block_tokens",
        "capacity_blocks",
        "evictions",
        "forecast_queue_evictions",
        "model",
        "offloaded",
        "ttl_s",
        "windows",
    )

    def __init__(
        self,
        capacity_blocks: int,
        model: str,
        ttl_s: float,
        inherited: Iterable[int] = (),
        clock: Callable[[], float] = monotonic,
        forecast_queue_evictions: bool = False,
        block_tokens: int | None = None,
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens  # the router's; None: the engine's own
        self.model = model
        self.ttl_s = ttl_s
        self.forecast_queue_evictions = forecast_queue_evictions
        self.evictions = 0  # blocks the engine announced removed
        self._clock = clock
        self._chains: dict[int, EngineChains] = {}
        self.offloaded = OffloadedBlocks(
            model,
            max(MIN_NAMES, OFFLOADED_NAMES_PER_CAPACITY_BLOCK * capacity_blocks),
            block_tokens,
        )
        # A hybrid model's sliding-window groups (empty for any other).
        self.windows = WindowGroups(
            max(MIN_NAMES, NAMES_PER_CAPACITY_BLOCK * capacity_blocks), block_tokens
        )
        self._held: Counter[int] = Counter()  # router hash -> ranks holding it
        self._inherited: OrderedDict[int, None] = OrderedDict.fromkeys(inherited)
        # (expiry, tick), oldest first: every entry gets the same ttl from its touch, and
        # the free-queue tick its touch gave it, which it keeps when announced.
        self._speculative: OrderedDict[int, tuple[float, int]] = OrderedDict()
        # With the forecast only: announced blocks in the engine's free-queue order, head
        # first, each with the tick of its last move (the ticks grow along the order).
        self._ticks = count()
        self._recency: OrderedDict[int, int] = OrderedDict()
        self._dispatched = 0  # requests dispatched here and not yet computed
        # (evictions, tick): blocks with a tick up to this, not reserved, are what that
        # many evictions take; None: not known since anything they depend on changed.
        self._doomed_after: tuple[int, int] | None = None
        self._trim_inherited()

    # -- what the engine announces ----------------------------------------------------

    def apply(self, rank: int, events: Iterable[Event]) -> None:
        removed: list[BlockHash] = []  # consecutive GPU removals, applied together
        windows = self.windows
        for event in events:
            if (
                isinstance(event, BlockRemoved)
                and not event.offloaded
                and not (windows and windows.is_windowed(rank, event.group_idx))
            ):
                removed += event.block_hashes
                continue
            if removed:
                self._removed(rank, removed)
                removed = []
            if isinstance(event, BlockRemoved) and event.offloaded:
                self.offloaded.removed(rank, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                windows.removed(rank, event.group_idx, event.block_hashes)
            elif isinstance(event, BlockStored) and event.offloaded:
                if not event.windowed:  # the tier's window groups: not read yet
                    self.offloaded.stored(rank, event, self._chain(rank))
            elif isinstance(event, BlockStored) and event.windowed:
                windows.stored(rank, event)
            elif isinstance(event, BlockStored):
                added, dropped = self._chain(rank).stored(event, self.offloaded.chains(rank))
                self._hold(added)
                self._release(dropped)
            else:  # the GPU's cache reset; the CPU tier keeps its blocks, as vLLM's does
                self._clear_device(rank)
        if removed:
            self._removed(rank, removed)
        if windows:
            # Their blocks are named by the full-attention group's announcements, which
            # come after theirs (in this piece of the batch or a later one).
            windows.resolve(rank, self._chain(rank))
        self._trim_inherited()

    def _removed(self, rank: int, engine_hashes: Sequence[BlockHash]) -> None:
        gone = self._chain(rank).removed(engine_hashes)
        self.evictions += len(gone)
        self._release(gone)

    def clear_rank(self, rank: int) -> None:
        """What the rank holds is not known any more (it restarted, or its stream
        broke): what it alone held goes, in both tiers, and with it whatever the router
        had not heard announced."""
        self._clear_device(rank)
        self.windows.clear_rank(rank)
        self.offloaded.clear_rank(rank)

    def _clear_device(self, rank: int) -> None:
        chains = self._chains.pop(rank, None)
        if chains is not None:
            self._release(chains.clear())
        self.windows.clear_blocks(rank)
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
            chains = self._chains[rank] = EngineChains(self.model, bound, self.block_tokens)
        return chains

    def _hold(self, router_hashes: Iterable[int]) -> None:
        held, speculative, inherited = self._held, self._speculative, self._inherited
        ordered = self.forecast_queue_evictions
        fresh: list[int] = []
        touched: list[tuple[int, int]] = []
        for h in router_hashes:
            before = held.get(h, 0)
            held[h] = before + 1
            if before:
                continue
            inherited.pop(h, None)
            guess = speculative.pop(h, None)
            if not ordered:
                continue
            if guess is None:
                fresh.append(h)
            else:
                touched.append((guess[1], h))
        if ordered:
            self._order(fresh, touched)

    def _order(self, fresh: list[int], touched: list[tuple[int, int]]) -> None:
        """Newly announced blocks into the free-queue order: where the request's end put
        a block, if that came before the announcement (it trails the step); the rest are
        in use by the request that stored them, so at the tail."""
        recency, ticks = self._recency, self._ticks
        for tick, h in sorted(touched):
            recency[h] = tick
        for h in fresh:
            recency[h] = next(ticks)
        self._doomed_after = None

    def _release(self, router_hashes: Iterable[int]) -> None:
        held, recency = self._held, self._recency
        for h in router_hashes:
            left = held[h] - 1
            if left > 0:
                held[h] = left
                continue
            held.pop(h, None)
            recency.pop(h, None)
        self._doomed_after = None

    def _trim_inherited(self) -> None:
        inherited = self._inherited
        while inherited and len(self._held) + len(inherited) > self.capacity_blocks:
            inherited.popitem(last=False)
            self._doomed_after = None

    # -- the residency interface the index uses -----------------------------------------

    def __len__(self) -> int:
        return len(self._held) + len(self._inherited)

    def __contains__(self, block_hash: object) -> bool:
        if block_hash in self._held or block_hash in self._inherited:
            return True
        if not isinstance(block_hash, int):
            return False
        entry = self._speculative.get(block_hash)
        return entry is not None and entry[0] > self._clock()

    def longest_prefix(self, hashes: Sequence[int], reserved: Mapping[int, int]) -> int:
        """Leading ``hashes`` held, announced or not yet, or reserved; with the forecast,
        and not doomed by what the requests dispatched before (``reserved``) need."""
        held = leading_held(hashes, self, reserved)
        if held and self.windows:
            held = self.windows.limit(hashes, held)
        if not held or not self.forecast_queue_evictions:
            return held
        doomed_after = self._doomed_tick(reserved)
        if doomed_after is None:
            return held
        recency = self._recency

        def doomed(h: int) -> bool:
            tick = recency.get(h)
            return tick is not None and tick <= doomed_after and h not in reserved

        if not doomed(hashes[held - 1]):
            return held
        low, high = 0, held - 1  # the first doomed block is in hashes[low:high + 1]
        while low < high:
            mid = (low + high) // 2
            if doomed(hashes[mid]):
                high = mid
            else:
                low = mid + 1
        return low

    def forecast_evictions(self, reserved: Mapping[int, int]) -> int:
        """How many cached blocks the requests dispatched here will take from the free
        queue's head: the blocks they reserved that the engine has not announced, and a
        partial last block each, less the free room."""
        announced = sum(map(self._held.__contains__, reserved))
        demand = len(reserved) - announced + self._dispatched
        return max(0, demand - max(0, self.capacity_blocks - len(self)))

    def _doomed_tick(self, reserved: Mapping[int, int]) -> int | None:
        """The tick of the last block the demand evicts (None: it evicts nothing);
        known until the order, the announcements or the dispatched requests change."""
        if self._doomed_after is None:
            evictions, last = self.forecast_evictions(reserved), -1
            left = evictions
            for h, tick in self._recency.items() if evictions else ():
                if h in reserved:
                    continue
                last = tick
                left -= 1
                if not left:
                    break
            self._doomed_after = (evictions, last)
        evictions, last = self._doomed_after
        return last if evictions else None

    def dispatched(self) -> None:
        """A request was dispatched here (its blocks are the index's reservation)."""
        self._dispatched += 1
        self._doomed_after = None

    def settled(self) -> None:
        """A dispatched request was computed, failed or was refused."""
        self._dispatched = max(0, self._dispatched - 1)
        self._doomed_after = None

    def touch(self, hashes: Sequence[int]) -> list[int]:
        """A request computed ``hashes`` here: speculative until the engine says so."""
        self._expire()
        speculative, held = self._speculative, self._held
        recency, ticks = self._recency, self._ticks
        ordered = self.forecast_queue_evictions
        expiry = self._clock() + self.ttl_s
        added: list[int] = []
        # To the free queue's tail, last block first: the engine frees a request's blocks
        # so that a prefix's tail is evicted before its head.
        for h in reversed(hashes[: self.capacity_blocks]):
            tick = next(ticks) if ordered else 0
            if h in held:
                if ordered:
                    recency[h] = tick
                    recency.move_to_end(h)
                continue
            if h in speculative:
                speculative.move_to_end(h)
            elif h not in self._inherited:
                added.append(h)
            speculative[h] = (expiry, tick)
        while len(speculative) > self.capacity_blocks:
            speculative.popitem(last=False)
        self._doomed_after = None
        return added

    def _expire(self) -> None:
        speculative, now = self._speculative, self._clock()
        while speculative:
            oldest, _ = next(iter(speculative.values()))
            if oldest > now:
                break
            speculative.popitem(last=False)

    def forget(self, hashes: Iterable[int]) -> None:
        """Drop guesses that turned out wrong; what the engine announced stays."""
        for h in hashes:
            self._speculative.pop(h, None)
            self._inherited.pop(h, None)
        self._doomed_after = None

    def oldest_first(self) -> list[int]:
        announced = self._recency if self.forecast_queue_evictions else self._held
        return [*self._inherited, *announced]

    def touched_before(self, when: float) -> list[int]:
        """All of it: the engine's announcements carry no times (a restored engine
        announces what it holds)."""
        return self.oldest_first()

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
        self._doomed_after = None
        self._trim_inherited()
