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
hashes as the full-attention group, which announces them in the same step, after the
window groups (and a long batch reaches the index in pieces): a window block is named
as the full-attention group's chains name its hash once they can (``resolve``, after
each piece), until then it counts for nothing (under-counted, never over-counted).
Removals carry the group's index. Each group keeps at most ``max_names`` names, the
oldest dropped first, and a worker at most ``MAX_GROUPS`` groups.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from router.index.chains import EngineChains
from router.index.events import BlockHash, BlockStored

# Window groups a worker may announce (vLLM makes a handful: a model's window layers
# over its full-attention ones); more are not followed.
MAX_GROUPS = 64
# Pieces of a batch a window block waits to be named by the full-attention group's
# announcement of it.
UNNAMED_TRIES = 2


class _Name:
    """A window block: the router's hashes for it (None: not named yet), and its stores
    not yet removed."""

    __slots__ = ("copies", "router_hashes")

    def __init__(self) -> None:
        self.router_hashes: Sequence[int] | None = None
        self.copies = 1


class _Window:
    __slots__ = ("blocks", "held", "names", "unnamed")

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks  # router blocks a hit needs, ending at the hit's end
        self.names: OrderedDict[BlockHash, _Name] = OrderedDict()  # oldest first
        # Names to look up, and how many pieces have been applied since they came: the
        # full-attention group announces its blocks in the same batch, so a block still
        # unnamed two pieces later was never announced there (not looked up again).
        self.unnamed: dict[BlockHash, int] = {}
        self.held: Counter[int] = Counter()


class WindowGroups:
    """One worker's sliding-window groups, per (rank, group index)."""

    __slots__ = ("_groups", "_ranks", "block_tokens", "dropped", "max_names")

    def __init__(self, max_names: int, block_tokens: int | None = None) -> None:
        self.max_names = max_names  # per group, as the GPU's chains are bounded
        self.block_tokens = block_tokens  # the router's block size; None: the engine's
        self._groups: dict[tuple[int, int], _Window] = {}
        self._ranks: dict[int, list[_Window]] = {}  # the same groups, by rank
        self.dropped = 0  # stores of groups past MAX_GROUPS, or without a group index

    def __bool__(self) -> bool:
        return bool(self._groups)

    def stored(self, rank: int, event: BlockStored) -> None:
        """``event`` is a windowed group's: its blocks, to be named (``resolve``)."""
        assert event.sliding_window is not None
        if event.group_idx is None:
            self.dropped += 1
            return
        ours = self._router_blocks(event.block_size)
        needed = -(-(event.sliding_window - 1) // event.block_size) * ours
        group = self._group(rank, event.group_idx, needed)
        if group is None:
            self.dropped += 1
            return
        names = group.names
        for engine_hash in event.block_hashes:
            known = names.get(engine_hash)
            if known is not None:
                known.copies += 1
                names.move_to_end(engine_hash)
                continue
            names[engine_hash] = _Name()
            group.unnamed[engine_hash] = 0
            if len(names) > self.max_names:
                oldest, name = names.popitem(last=False)
                self._forget(group, oldest, name)

    def resolve(self, rank: int, device: EngineChains) -> None:
        """Name the rank's window blocks the full-attention chains can name now."""
        for group in self._ranks.get(rank, ()):
            for engine_hash, tries in list(group.unnamed.items()):
                router_hashes = device.router_hashes_of(engine_hash)
                if router_hashes is None:
                    if tries >= UNNAMED_TRIES:
                        del group.unnamed[engine_hash]
                    else:
                        group.unnamed[engine_hash] = tries + 1
                    continue
                del group.unnamed[engine_hash]
                group.names[engine_hash].router_hashes = router_hashes
                group.held.update(router_hashes)

    def removed(self, rank: int, group_idx: int | None, engine_hashes: Sequence[BlockHash]) -> bool:
        """Apply a removal if it is a windowed group's; whether it was."""
        group = self._groups.get((rank, group_idx)) if group_idx is not None else None
        if group is None:
            return False
        for engine_hash in engine_hashes:
            known = group.names.get(engine_hash)
            if known is None:
                continue
            if known.copies > 1:
                known.copies -= 1
                continue
            del group.names[engine_hash]
            self._forget(group, engine_hash, known)
        return True

    def is_windowed(self, rank: int, group_idx: int | None) -> bool:
        return group_idx is not None and (rank, group_idx) in self._groups

    def clear_rank(self, rank: int) -> None:
        for key in [key for key in self._groups if key[0] == rank]:
            del self._groups[key]
        self._ranks.pop(rank, None)

    def clear_blocks(self, rank: int) -> None:
        """The rank's cache was reset: its groups stay known, empty."""
        for group in self._ranks.get(rank, ()):
            group.names.clear()
            group.unnamed.clear()
            group.held.clear()

    def limit(self, hashes: Sequence[int], hit: int) -> int:
        """The longest hit of at most ``hit`` leading ``hashes`` (what full attention
        holds) that every window group of one rank allows: the largest ``n`` whose last
        window's blocks, ``hashes[n - window : n]``, each of them holds."""
        best = 0
        for groups in self._ranks.values():
            n = hit
            while n > best:
                allowed = min(_window_end(g, hashes, n) for g in groups)
                if allowed == n:
                    break
                n = allowed
            best = max(best, n)
        return best

    def _group(self, rank: int, index: int, needed: int) -> _Window | None:
        group = self._groups.get((rank, index))
        if group is not None and group.blocks == needed:
            return group
        if group is None and len(self._groups) >= MAX_GROUPS:
            return None
        if group is not None:
            self._ranks[rank].remove(group)
        group = self._groups[(rank, index)] = _Window(needed)
        self._ranks.setdefault(rank, []).append(group)
        return group

    @staticmethod
    def _forget(group: _Window, engine_hash: BlockHash, name: _Name) -> None:
        group.unnamed.pop(engine_hash, None)
        held = group.held
        for h in name.router_hashes or ():
            left = held[h] - 1
            if left > 0:
                held[h] = left
            else:
                del held[h]

    def _router_blocks(self, engine_block: int) -> int:
        if self.block_tokens is None:
            return 1
        return max(1, engine_block // self.block_tokens)


def _window_end(group: _Window, hashes: Sequence[int], n: int) -> int:
    """The largest ``m <= n`` whose last window the group holds, scanning back from
    ``n`` once (as vLLM's ``SlidingWindowManager.find_longest_cache_hit``): a block it
    lacks at ``j`` rules out every window ending at or before ``j + window``."""
    held, window = group.held, group.blocks
    end = n
    j = n - 1
    while j >= 0 and end - j <= window:
        if hashes[j] in held:
            j -= 1
            continue
        end = j  # every window ending after j holds j
        j -= 1
    return end
