"""The CPU tier vLLM's offloading connector keeps beside the GPU's KV cache.

As vLLM 0.32's native offloading (``--kv-offloading-backend native
--kv-offloading-size GIB``; ``v1/kv_offload/cpu/manager.py``) keeps it, with one GPU
block per offloaded chunk:

* Write-through: every block the GPU caches is stored to CPU memory as it is computed,
  whether or not the GPU will evict it; a block already there is not stored again.
* The tier is an LRU of its own: storing into a full tier evicts its least recently
  used blocks; a lookup that hits touches what it found, and a request's end its
  blocks, each last block first (``policies/lru.py``: ``touch``,
  ``on_request_finished``), so a prompt's tail goes before its head.
* A request looks here for what continues its GPU prefix hit: the run of blocks after
  the GPU's, all present, is loaded back over the host link before the request runs
  (``Scheduler._schedule_waiting``), and counts as cached in its usage.
* A GPU eviction leaves the CPU copy; only the tier's own eviction loses the block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


class OffloadTier:
    __slots__ = ("_blocks", "capacity_blocks", "on_evict")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("an offload tier needs at least one block")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()  # pool hashes, LRU first
        # Told each pool hash the tier drops (the CPU medium's BlockRemoved).
        self.on_evict: Callable[[int], None] | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, pool_hash: object) -> bool:
        return pool_hash in self._blocks

    def continuation(self, hashes: Sequence[int], start: int, end: int) -> int:
        """How many of ``hashes[start:end]`` the tier holds, from ``start`` on, unbroken."""
        blocks = self._blocks
        found = 0
        for h in hashes[start:end]:
            if h not in blocks:
                break
            found += 1
        return found

    def touch(self, hashes: Sequence[int]) -> None:
        """Most recent: ``hashes``, the first of them the most recent of all."""
        blocks = self._blocks
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)

    def store(self, hashes: Sequence[int]) -> list[bool]:
        """Store ``hashes`` (a request's newly cached blocks, in order); which were new
        here. Blocks already held are touched; a full tier evicts its oldest first,
        never one of ``hashes``."""
        blocks = self._blocks
        fresh = [h not in blocks for h in hashes]
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
                continue
            if len(blocks) >= self.capacity_blocks:
                self._evict_oldest()
            blocks[h] = None
        return fresh

    def _evict_oldest(self) -> None:
        evicted, _ = self._blocks.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(evicted)

    def reset(self) -> None:
        """Forget everything (an engine restart: CPU memory is the process's)."""
        self._blocks.clear()
