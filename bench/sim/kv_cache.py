"""The KV block pool, kept the way vLLM's prefix cache keeps it.

* Memory is a fixed number of blocks of ``block_tokens`` tokens.
* A full block, once computed, is registered under its chained hash; a later request
  whose prompt starts with the same blocks reuses them (a prefix-cache hit).
* Blocks in use by a running request are pinned (reference count > 0).
* When a request finishes, its blocks go to the tail of an LRU free queue, last block
  first, so a prefix's tail is evicted before its head. Freed blocks keep their hash and
  can still be hit until they are reused.
* Allocation takes the block at the head of the free queue (the least recently freed)
  and drops its hash: that is eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

NO_HASH = -1


class BlockPool:
    __slots__ = ("_cached", "_free", "_hash", "_ref", "block_tokens", "num_blocks")

    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self._ref = [0] * num_blocks
        self._hash = [NO_HASH] * num_blocks
        self._cached: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks pinned by running requests (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    def cached_prefix(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the longest run of leading ``hashes`` that are cached."""
        found: list[int] = []
        cached = self._cached
        for h in hashes[:max_blocks]:
            block = cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def free_among(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the free queue (touching them consumes free space)."""
        ref = self._ref
        return sum(1 for b in blocks if ref[b] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Pin cached blocks for a request that hit them."""
        ref, free = self._ref, self._free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks from the LRU head, evicting their cached contents."""
        if count > len(self._free):
            raise MemoryError(f"need {count} blocks, {len(self._free)} free")
        blocks: list[int] = []
        free, ref, hashes, cached = self._free, self._ref, self._hash, self._cached
        for _ in range(count):
            b, _ = free.popitem(last=False)
            h = hashes[b]
            if h != NO_HASH:
                if cached.get(h) == b:
                    del cached[h]
                hashes[b] = NO_HASH
            ref[b] = 1
            blocks.append(b)
        return blocks

    def register(self, block: int, block_hash: int) -> None:
        """Record that a full block now holds the prefix named by ``block_hash``."""
        if block_hash not in self._cached:
            self._cached[block_hash] = block
            self._hash[block] = block_hash

    def release(self, blocks: Sequence[int]) -> None:
        """Unpin a request's blocks; the unreferenced go to the free tail, last block first."""
        ref, free = self._ref, self._free
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None

    def reset(self) -> None:
        """Forget everything (an engine restart). Only valid with no request running."""
        self.__init__(self.num_blocks, self.block_tokens)  # type: ignore[misc]
