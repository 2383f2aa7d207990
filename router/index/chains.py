"""The router's own block hashes for the blocks an engine announces.

An engine names a block by its hash, whose algorithm and seed the router never needs:
each ``BlockStored`` carries the block's tokens and its parent's engine hash, so the
router chains its own hashes over the same tokens (``router.index.prefix``, 4 bytes a token,
seeded by the model and cache_salt as a request's key is) and keeps, per worker, which
engine hash is which of its own. A block whose parent it never saw cannot be named and
is skipped: the router then under-counts what the engine holds, never over-counts.

The router's blocks may be smaller than the engine's: an engine block of ``n`` router
blocks is named by all ``n`` router hashes (chained over its tokens in order), held and
released together. The engine's block size must be a whole number of the router's.

vLLM caches a block computed twice (two requests prefilling the same prefix at once) in
both copies and announces, and later removes, each: an engine hash is held until it has
been removed as often as it was stored. Several engine hashes can map to one router hash
(two attention groups, a key the router does not see); a router hash is held while any
of them is.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from router.index.events import BlockHash, BlockStored
from router.index.prefix import chain_seed
from router.wire.blocks import TOKEN_BYTES, chain_hashes, token_bytes


class _Name:
    """An announced engine block: the router's hashes for it (its tokens in router blocks,
    in order), and its stores not yet removed."""

    __slots__ = ("copies", "router_hashes")

    def __init__(self, router_hashes: Sequence[int]) -> None:
        self.router_hashes = router_hashes
        self.copies = 1


class EngineChains:
    """One worker's engine-hash to router-hash map, bounded to ``max_blocks`` router
    blocks whatever block size the engine claims (the oldest engine blocks dropped
    first, should removals go missing). ``block_tokens``: the router's block size;
    None: the engine's own."""

    __slots__ = (
        "_held",
        "_named",
        "_names",
        "block_tokens",
        "max_blocks",
        "model",
        "orphans",
    )

    def __init__(self, model: str, max_blocks: int, block_tokens: int | None = None) -> None:
        self.model = model  # the base model the worker serves (a LoRA names itself)
        self.max_blocks = max_blocks
        self.block_tokens = block_tokens
        self._names: OrderedDict[BlockHash, _Name] = OrderedDict()
        self._held: Counter[int] = Counter()  # engine hashes held, per router hash
        self._named = 0  # router hashes over all the names
        self.orphans = 0  # stored blocks skipped: their parent was never announced

    def __len__(self) -> int:
        return len(self._names)

    @property
    def router_blocks(self) -> int:
        """The router blocks the announced engine blocks stand for."""
        return self._named

    def stored(
        self, event: BlockStored, elsewhere: EngineChains | None = None
    ) -> tuple[list[int], list[int]]:
        """The router hashes the event adds, and those that the bound pushed out.
        ``elsewhere``: the same engine's chains for another tier, where a parent not
        announced here may have been (one engine names a block alike in every tier)."""
        ours_per_block = self._router_blocks_per_engine_block(event.block_size)
        if event.parent_block_hash is None:
            parent = chain_seed(event.lora_name or self.model, event.cache_salt)
        else:
            known = self._names.get(event.parent_block_hash)
            if known is None and elsewhere is not None:
                known = elsewhere._names.get(event.parent_block_hash)
            if known is None:
                self.orphans += len(event.block_hashes)
                return [], []
            parent = known.router_hashes[-1]
        block_bytes = event.block_size // ours_per_block * TOKEN_BYTES
        ours = chain_hashes(token_bytes(event.token_ids), block_bytes, parent)
        return self._name(
            (engine_hash, ours[i * ours_per_block : (i + 1) * ours_per_block])
            for i, engine_hash in enumerate(event.block_hashes)
        )

    def router_hashes_of(self, engine_hash: BlockHash) -> Sequence[int] | None:
        """The router's hashes for an announced engine block (None: not announced)."""
        name = self._names.get(engine_hash)
        return None if name is None else name.router_hashes

    def named_as_in(
        self, engine_hashes: Sequence[BlockHash], elsewhere: EngineChains
    ) -> tuple[list[int], list[int], int]:
        """Blocks announced by hash alone (a CPU tier's placeholders), named as
        ``elsewhere`` (the GPU's chains) names them: the router hashes added, those the
        bound pushed out, and how many blocks ``elsewhere`` could not name (skipped)."""
        known = [(h, elsewhere._names.get(h)) for h in engine_hashes]
        added, dropped = self._name((h, n.router_hashes) for h, n in known if n is not None)
        unnamed = sum(1 for _, n in known if n is None)
        self.orphans += unnamed
        return added, dropped, unnamed

    def _name(
        self, blocks: Iterable[tuple[BlockHash, Sequence[int]]]
    ) -> tuple[list[int], list[int]]:
        added: list[int] = []
        names, held = self._names, self._held  # a loop over thousands of blocks a second
        for engine_hash, router_hashes in blocks:
            name = names.get(engine_hash)
            if name is not None:
                name.copies += 1
                names.move_to_end(engine_hash)
                continue
            names[engine_hash] = _Name(router_hashes)
            self._named += len(router_hashes)
            for router_hash in router_hashes:
                count = held.get(router_hash, 0) + 1
                held[router_hash] = count
                if count == 1:
                    added.append(router_hash)
        dropped: list[int] = []
        while self._named > self.max_blocks:
            _, name = self._names.popitem(last=False)
            dropped += self._release(name.router_hashes)
        return added, dropped

    def _router_blocks_per_engine_block(self, engine_block: int) -> int:
        if self.block_tokens is None:
            return 1
        if engine_block % self.block_tokens:
            raise ValueError(
                f"an engine block of {engine_block} tokens is not a whole number of "
                f"the router's {self.block_tokens}-token blocks"
            )
        return engine_block // self.block_tokens

    def removed(self, engine_hashes: Sequence[BlockHash]) -> list[int]:
        """The router hashes no engine block holds any more."""
        gone: list[int] = []
        for engine_hash in engine_hashes:
            name = self._names.get(engine_hash)
            if name is None:
                continue
            name.copies -= 1
            if name.copies == 0:
                del self._names[engine_hash]
                gone += self._release(name.router_hashes)
        return gone

    def clear(self) -> list[int]:
        """Forget every block; returns the router hashes that were held."""
        held = list(self._held)
        self._names.clear()
        self._held.clear()
        self._named = 0
        return held

    def _release(self, router_hashes: Sequence[int]) -> list[int]:
        self._named -= len(router_hashes)
        released: list[int] = []
        held = self._held
        for router_hash in router_hashes:
            left = held[router_hash] - 1
            if left > 0:
                held[router_hash] = left
            else:
                del held[router_hash]
                released.append(router_hash)
        return released
