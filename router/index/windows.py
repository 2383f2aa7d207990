"""A hybrid model's sliding-window groups as its engine announces them, and the prefix
hit they allow.

A model that mixes sliding-window layers with full-attention ones (Gemma 3, GPT-OSS)
keeps a KV cache group per kind; vLLM's hybrid allocator finds a prefix hit that every
group accepts (``HybridKVCacheCoordinator.find_longest_cache_hit``): full attention
needs every block of the prefix, a sliding-window group only the blocks of its last
window, ``cdiv(window - 1, block)`` of them, ending where the hit ends. And a
sliding-window group keeps little: the window before the points a later request can
hit (each prompt's end, a prefix two prompts share), never the blocks of a reply. So a
turn that extends the previous one (its prompt, the reply, the new message) hits only
as far as the previous prompt's end, although the full-attention group holds the reply
too; and a prompt that shares blocks with another but not the window before where they
part hits nothing.

A window group's ``BlockStored`` names only the blocks it keeps, by the same engine
hashes as the full-attention group: they are named here as the GPU's chains named them
(a block the full-attention group never announced is skipped: under-counted, never
over-counted). Removals carry the group's index.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from router.index.chains import EngineChains
from router.index.events import BlockHash, BlockStored

# Window checks tried per prediction, walking the hit back from the full-attention match:
# past this many the rest of the prompt is taken as not hit (under-counted).
MAX_WINDOW_CHECKS = 4096


class _Window:
    __slots__ = ("blocks", "held", "names")

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks  # engine blocks a hit needs, ending at the hit's end
        self.names: dict[BlockHash, tuple[Sequence[int], int]] = {}  # -> router hashes, copies
        self.held: Counter[int] = Counter()


class WindowGroups:
    """One worker's sliding-window groups, per rank."""

    __slots__ = ("_groups", "block_tokens", "max_names", "unnamed")

    def __init__(self, max_names: int, block_tokens: int | None = None) -> None:
        self.max_names = max_names  # per group, as the GPU's chains are bounded
        self.block_tokens = block_tokens  # the router's block size; None: the engine's
        self._groups: dict[tuple[int, int], _Window] = {}
        self.unnamed = 0

    def __bool__(self) -> bool:
        return bool(self._groups)

    def stored(self, rank: int, event: BlockStored, device: EngineChains) -> None:
        """``event`` is a windowed group's; ``device`` the rank's full-attention chains."""
        assert event.sliding_window is not None
        ours = self._router_blocks(event.block_size)
        needed = -(-(event.sliding_window - 1) // event.block_size) * ours
        group = self._groups.get((rank, event.group_idx or 0))
        if group is None or group.blocks != needed:
            group = self._groups[(rank, event.group_idx or 0)] = _Window(needed)
        for engine_hash in event.block_hashes:
            known = group.names.get(engine_hash)
            if known is not None:
                group.names[engine_hash] = (known[0], known[1] + 1)
                continue
            router_hashes = device.router_hashes_of(engine_hash)
            if router_hashes is None or len(group.names) >= self.max_names:
                self.unnamed += 1
                continue
            group.names[engine_hash] = (router_hashes, 1)
            group.held.update(router_hashes)

    def removed(self, rank: int, group_idx: int | None, engine_hashes: Sequence[BlockHash]) -> bool:
        """Apply a removal if it is a windowed group's; whether it was."""
        group = self._groups.get((rank, group_idx or 0))
        if group is None:
            return False
        for engine_hash in engine_hashes:
            known = group.names.pop(engine_hash, None)
            if known is None:
                continue
            router_hashes, copies = known
            if copies > 1:
                group.names[engine_hash] = (router_hashes, copies - 1)
                continue
            for h in router_hashes:
                left = group.held[h] - 1
                if left > 0:
                    group.held[h] = left
                else:
                    del group.held[h]
        return True

    def is_windowed(self, rank: int, group_idx: int | None) -> bool:
        return (rank, group_idx or 0) in self._groups

    def clear_rank(self, rank: int) -> None:
        for key in [key for key in self._groups if key[0] == rank]:
            del self._groups[key]

    def clear_blocks(self, rank: int) -> None:
        """The rank's cache was reset: its groups stay known, empty."""
        for (r, _), group in self._groups.items():
            if r == rank:
                group.names.clear()
                group.held.clear()

    def limit(self, hashes: Sequence[int], held: int) -> int:
        """The longest hit of at most ``held`` leading ``hashes`` (what full attention
        holds) that every window group of one rank allows: the largest ``n`` whose last
        window's blocks, ``hashes[n - window : n]``, each of them holds."""
        ranks: dict[int, list[_Window]] = {}
        for (rank, _), group in self._groups.items():
            ranks.setdefault(rank, []).append(group)
        for checks, n in enumerate(range(held, 0, -1)):
            if checks >= MAX_WINDOW_CHECKS:
                break
            for groups in ranks.values():
                if all(all(h in g.held for h in hashes[max(0, n - g.blocks) : n]) for g in groups):
                    return n
        return 0

    def _router_blocks(self, engine_block: int) -> int:
        if self.block_tokens is None:
            return 1
        return max(1, engine_block // self.block_tokens)
