"""The KV block pool, kept the way vLLM's prefix cache keeps it.

* Memory is a fixed number of blocks of ``block_tokens`` tokens.
* A full block, once computed, is registered under its chained hash; a later request
  whose prompt starts with the same blocks reuses them (a prefix-cache hit).
* Blocks in use by a running request are pinned (reference count > 0).
* When a request finishes, its cached blocks go to the tail of an LRU free queue, last
  block first, so a prefix's tail is evicted before its head; freed blocks that hold no
  hash (a prompt's partial last block) go to its head, to be reused first (vLLM 0.32's
  ``BlockPool.free_blocks``). Freed blocks keep their hash and can still be hit until
  they are reused.
* Allocation takes the block at the head of the free queue (the least recently freed)
  and drops its hash: that is eviction.

The free queue is a deque of entries, each a block id tagged with the release that
queued it, rather than an ordered dict: a hit on a free block (``touch``) takes it out
of the queue by forgetting its live entry, and the stale entry is skipped when it
reaches the head (or dropped when stale entries outnumber the blocks). Every block has
at most one live entry, in the order an ordered set would keep, so blocks are handed
out and evicted in the same order; appending to a deque costs a fraction of inserting
into an ordered dict, and a request frees hundreds of blocks.
``tests/sim/fronts/test_sim_shortcuts.py`` checks the pool against an ordered-dict model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

NO_HASH = -1
NOT_FREE = -1  # ``_entry`` of a block not in the free queue (entries are >= 0)


class BlockPool:
    __slots__ = (
        "_cached",
        "_entry",
        "_hash",
        "_id_bits",
        "_id_mask",
        "_num_free",
        "_queue",
        "_ref",
        "_releases",
        "block_tokens",
        "num_blocks",
        "on_evict",
    )

    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self._ref = [0] * num_blocks
        self._hash = [NO_HASH] * num_blocks
        self._cached: dict[int, int] = {}
        # An entry is ``release << _id_bits | block``; it is live while ``_entry[block]``
        # holds it. Every block starts free, queued by release 0 in id order.
        self._id_bits = num_blocks.bit_length()
        self._id_mask = (1 << self._id_bits) - 1
        self._releases = 0
        self._entry = list(range(num_blocks))
        self._queue: deque[int] = deque(self._entry)
        self._num_free = num_blocks
        # Told each cached hash a reused block drops (the KV events' BlockRemoved).
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return self._num_free

    def usage(self) -> float:
        """Fraction of blocks pinned by running requests (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self._num_free / self.num_blocks

    def free_blocks(self) -> list[int]:
        """The free queue, least recently freed first (the next to be handed out)."""
        entry, mask = self._entry, self._id_mask
        return [e & mask for e in self._queue if entry[e & mask] == e]

    def cached_prefix(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the longest run of leading ``hashes`` that are cached."""
        return self.prefix_hit(hashes, max_blocks)[0]

    def prefix_hit(self, hashes: Sequence[int], max_blocks: int) -> tuple[list[int], int]:
        """``cached_prefix`` and, in the same pass, ``free_among`` of its blocks."""
        found: list[int] = []
        append, get, ref = found.append, self._cached.get, self._ref
        free = 0
        for h in hashes[:max_blocks]:
            block = get(h)
            if block is None:
                break
            append(block)
            if not ref[block]:
                free += 1
        return found, free

    def free_among(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the free queue (touching them consumes free space)."""
        ref = self._ref
        return sum(1 for b in blocks if ref[b] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Pin cached blocks for a request that hit them."""
        ref, entry = self._ref, self._entry
        taken = 0
        for b in blocks:
            count = ref[b]
            if not count:
                entry[b] = NOT_FREE
                taken += 1
            ref[b] = count + 1
        self._num_free -= taken

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks from the LRU head, evicting their cached contents."""
        if count > self._num_free:
            raise MemoryError(f"need {count} blocks, {self._num_free} free")
        blocks: list[int] = []
        append, popleft = blocks.append, self._queue.popleft
        entry, mask, ref, hashes = self._entry, self._id_mask, self._ref, self._hash
        for _ in range(count):
            e = popleft()
            b = e & mask
            while entry[b] != e:  # taken out by a hit since it was queued
                e = popleft()
                b = e & mask
            entry[b] = NOT_FREE
            ref[b] = 1
            if hashes[b] != NO_HASH:
                self._evict(b)
            append(b)
        self._num_free -= count
        return blocks

    def _evict(self, block: int) -> None:
        """Forget what a block being handed out held."""
        h = self._hash[block]
        if self._cached.get(h) == block:
            del self._cached[h]
            if self.on_evict is not None:
                self.on_evict(h)
        self._hash[block] = NO_HASH

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def register(self, block: int, block_hash: int) -> None:
        """Record that a full block now holds the prefix named by ``block_hash``."""
        if block_hash not in self._cached:
            self._cached[block_hash] = block
            self._hash[block] = block_hash

    def register_blocks(self, blocks: Sequence[int], block_hashes: Sequence[int]) -> None:
        """``register`` of each block with its hash, in order."""
        cached, hashes = self._cached, self._hash
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block_hash not in cached:
                cached[block_hash] = block
                hashes[block] = block_hash

    def release(self, blocks: Sequence[int]) -> None:
        """Unpin a request's blocks; the unreferenced go to the free queue, last block
        first: the cached ones to its tail, the others to its head."""
        ref, entry, queue, hashes = self._ref, self._entry, self._queue, self._hash
        append = queue.append
        self._releases += 1
        tag = self._releases << self._id_bits
        before = len(queue)
        first: list[int] = []  # holding no hash: reused first
        for b in reversed(blocks):
            left = ref[b] - 1
            ref[b] = left
            if not left:
                if hashes[b] == NO_HASH:
                    first.append(b)
                    continue
                entry[b] = e = tag | b
                append(e)
        for b in reversed(first):
            entry[b] = e = tag | b
            queue.appendleft(e)
        self._num_free += len(queue) - before
        if len(queue) > 2 * self.num_blocks:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale entries (hits pile them up while nothing is allocated)."""
        entry, mask = self._entry, self._id_mask
        self._queue = deque(e for e in self._queue if entry[e & mask] == e)

    def eviction_order(self, held: Sequence[Sequence[int]]) -> list[int]:
        """Every block's hash (``NO_HASH`` if empty), in the order the blocks would be
        handed out once the requests holding ``held`` (each one's blocks, in the order it
        would release them) let go of them: the free queue, then each list released as
        ``release`` does. ``held`` must account for every pin (a checkpoint's view: a
        restored engine runs nothing, so its running requests' blocks are free there)."""
        ref = list(self._ref)
        order = self.free_blocks()
        for blocks in held:
            released: list[int] = []
            first: list[int] = []
            for b in reversed(blocks):
                ref[b] -= 1
                if not ref[b]:
                    (first if self._hash[b] == NO_HASH else released).append(b)
            order = [*first, *order, *released]
        if len(order) != self.num_blocks:
            raise ValueError("the blocks held do not account for every pinned block")
        return [self._hash[b] for b in order]

    def load(self, hashes: Sequence[int]) -> None:
        """Start over with every block free, block ``i`` holding ``hashes[i]`` (``NO_HASH``:
        empty) and handed out ``i``-th: the inverse of ``eviction_order``. Only valid
        with no request running."""
        if len(hashes) != self.num_blocks:
            raise ValueError(f"{len(hashes)} block hashes for a pool of {self.num_blocks}")
        cached = {h: b for b, h in enumerate(hashes) if h != NO_HASH}
        if len(cached) != self.num_blocks - hashes.count(NO_HASH):
            raise ValueError("a block hash is held by two blocks")
        self.reset()
        self._hash = list(hashes)
        self._cached = cached

    def reset(self) -> None:
        """Forget everything (an engine restart). Only valid with no request running."""
        on_evict = self.on_evict
        self.__init__(self.num_blocks, self.block_tokens)  # type: ignore[misc]
        self.on_evict = on_evict
