"""A worker's CPU tier as its engine announces it: the blocks its offloading connector
keeps in host memory, named with the router's hashes as the GPU's are.

vLLM's offloading connector writes every block the GPU caches through to CPU memory and
announces it there (``BlockStored`` with medium ``CPU``); its own LRU announces what it
drops. A block evicted from the GPU is still here, and reading it back over the host
link is far cheaper than computing it again: a request whose GPU hit stops short finds
the rest here (``continuation``), and the engine loads it before running the request.

With the connector's ``self_describing_kv_events`` a store carries its tokens and parent,
chained like a GPU store (a parent announced only on the GPU is found there). Without,
a store is a placeholder naming the block by hash alone: it is named as the GPU's chains
name that hash, which works while the GPU still holds the block (the store follows the
computation by a step or so); a placeholder for a block the GPU has already dropped
cannot be named and is skipped (``unnamed``).

The connector offloads in chunks of one block or more (its ``block_size``), announced
one event a chunk, and loads whole chunks only: a lookup starts at the chunk holding
the GPU hit's end and counts the chunks held whole from there, none past the prompt's
last whole chunk (vLLM's ``_lookup_complete_chunks``). ``continuation`` does the same,
the chunk's size learned from the stores (a placeholder names a chunk by its last
block alone: the rest of its blocks are not named, under-counted).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from router.index.chains import EngineChains
from router.index.events import BlockHash, BlockStored

# Blocks an offloaded chunk can hold (vLLM's are a few): a store claiming more is taken
# as this many, so one odd event cannot make every continuation nothing.
MAX_CHUNK_BLOCKS = 64


class OffloadedBlocks:
    __slots__ = (
        "_chains",
        "_held",
        "block_tokens",
        "chunk_blocks",
        "described",
        "max_blocks",
        "model",
        "stores",
        "unnamed",
    )

    def __init__(self, model: str, max_blocks: int, block_tokens: int | None = None) -> None:
        self.model = model
        self.max_blocks = max_blocks  # names kept per rank, as the GPU's chains
        self.block_tokens = block_tokens
        self._chains: dict[int, EngineChains] = {}
        self._held: Counter[int] = Counter()  # router hash -> ranks holding it
        self.chunk_blocks = 1  # router blocks a chunk holds (its stores say)
        self.stores = 0  # CPU-tier stores heard (placeholders too)
        self.described = 0  # of them, stores with their tokens (self-describing)
        self.unnamed = 0  # placeholder blocks the GPU's chains could not name

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, router_hash: object) -> bool:
        return router_hash in self._held

    def stored(self, rank: int, event: BlockStored, device: EngineChains) -> None:
        """``device``: the same rank's GPU chains."""
        chains = self._chain(rank)
        self.stores += 1
        if event.placeholder:
            added, dropped, unnamed = chains.named_as_in(event.block_hashes, device)
            self.unnamed += unnamed
        else:
            self.described += 1
            per_block = max(1, event.block_size // (self.block_tokens or event.block_size))
            blocks = min(max(1, len(event.block_hashes)), MAX_CHUNK_BLOCKS)
            self.chunk_blocks = blocks * per_block
            added, dropped = chains.stored(event, device)
        self._hold(added)
        self._release(dropped)

    def removed(self, rank: int, engine_hashes: Sequence[BlockHash]) -> None:
        chains = self._chains.get(rank)
        if chains is not None:
            self._release(chains.removed(engine_hashes))

    def clear_rank(self, rank: int) -> None:
        chains = self._chains.pop(rank, None)
        if chains is not None:
            self._release(chains.clear())

    def chains(self, rank: int) -> EngineChains | None:
        """The rank's CPU-tier chains, if it announced any."""
        return self._chains.get(rank)

    def continuation(self, hashes: Sequence[int], start: int) -> int:
        """How many of ``hashes`` from ``start`` on a request whose GPU hit ends at
        ``start`` would load back: the whole chunks the tier holds from the one that
        holds ``start``, none if that is less than a chunk."""
        held, size = self._held, self.chunk_blocks
        chunk, end = start // size, start
        while (chunk + 1) * size <= len(hashes) and all(
            h in held for h in hashes[chunk * size : (chunk + 1) * size]
        ):
            chunk += 1
            end = chunk * size
        return end - start if end - start >= size else 0  # vLLM loads no less than a chunk

    def _chain(self, rank: int) -> EngineChains:
        chains = self._chains.get(rank)
        if chains is None:
            chains = self._chains[rank] = EngineChains(
                self.model, self.max_blocks, self.block_tokens
            )
        return chains

    def _hold(self, router_hashes: Iterable[int]) -> None:
        self._held.update(router_hashes)

    def _release(self, router_hashes: Iterable[int]) -> None:
        held = self._held
        for h in router_hashes:
            left = held[h] - 1
            if left > 0:
                held[h] = left
            else:
                held.pop(h, None)


class ModelledTier:
    """An approximate worker's CPU tier, modelled as its engine keeps it: every block the
    worker computes written through to an LRU of the tier's size, touched tail first as
    the GPU's model is (so a prefix's tail goes before its head)."""

    __slots__ = ("_lru", "capacity_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, router_hash: object) -> bool:
        return router_hash in self._lru

    def touch(self, hashes: Sequence[int]) -> None:
        lru = self._lru
        for h in reversed(hashes[: self.capacity_blocks]):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)

    def forget(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._lru.pop(h, None)

    def continuation(self, hashes: Sequence[int], start: int) -> int:
        lru, found = self._lru, 0
        for h in hashes[start:]:
            if h not in lru:
                break
            found += 1
        return found
