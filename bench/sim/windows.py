"""A hybrid model's sliding-window groups, as vLLM 0.32's hybrid allocator keeps them.

A model that mixes sliding-window layers with full-attention ones keeps a KV cache
group per kind (vLLM groups layers so each group has as many as the full-attention
group: a 2:1 pattern gives two window groups and one full), all drawing blocks from one
pool. What is observable of the window groups, and simulated here:

* **What they keep.** With vLLM's default ``prefix_cache_retention_interval`` of 0, a
  window group caches only the window's blocks before the points a later request can
  hit: ``cdiv(window - 1, block)`` blocks ending at block ``(prompt_tokens - 1) //
  block``, the prompt's last whole block short of its last token
  (``kv_cache_coordinator.py``), and the window before where its prompt parted from a
  cached one (the *junction*: where the full-attention hit ended, when the window
  groups cut it short; ``kv_cache_manager.py``); never a reply's blocks.
* **The hit.** ``HybridKVCacheCoordinator.find_longest_cache_hit``: the full-attention
  hit walked back until every window group holds the window's blocks ending there.
* **Their memory.** Each kept block is a block of the shared pool, cached under a key
  of its own (the group and the block's hash), freed to the pool's free queue and
  evicted from it like any other. (The window blocks a prompt uses while it is being
  computed, freed as the window slides, are not simulated.)
* **Their events.** Each group announces its stores (``kv_cache_spec_kind``
  ``sliding_window``, its window, ``group_idx``), before the full-attention group's in
  the step's batch, naming the blocks it keeps while its ``token_ids`` span every block
  the step computed; and its removals with its ``group_idx``.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


class WindowGroups:
    __slots__ = ("_keys", "blocks", "held", "window")

    def __init__(self, window: int, groups: int, block_tokens: int) -> None:
        if window < 1 or groups < 1:
            raise ValueError("a window group needs a window and a count")
        self.window = window  # tokens
        self.blocks = -(-(window - 1) // block_tokens)  # a hit needs these, ending there
        self.held: list[set[int]] = [set() for _ in range(groups)]  # pool hashes, per group
        self._keys: dict[int, tuple[int, int]] = {}  # pool key -> (group, pool hash)

    @property
    def groups(self) -> int:
        return len(self.held)

    def limit(self, hashes: Sequence[int], hit: int) -> int:
        """The longest of the first ``hit`` blocks' prefixes whose last window every
        group holds (0 when none does)."""
        for n in range(hit, 0, -1):
            window = hashes[max(0, n - self.blocks) : n]
            if all(all(h in held for h in window) for held in self.held):
                return n
        return 0

    def to_keep(
        self, hashes: Sequence[int], prompt_tokens: int, block_tokens: int, junction: int = 0
    ) -> list[int]:
        """The block indexes a computed prompt leaves in the window groups: the window
        before its last whole block short of its last token, and the window before
        ``junction`` (blocks; 0: none)."""
        end = min(len(hashes), (prompt_tokens - 1) // block_tokens)
        stops = (stop for stop in (junction, end) if stop)
        return sorted({i for stop in stops for i in range(max(0, stop - self.blocks), stop)})

    def key(self, group: int, pool_hash: int) -> int | None:
        """The pool key the group's block of ``pool_hash`` is cached under; None: the
        group holds it already."""
        if pool_hash in self.held[group]:
            return None
        key = xxhash.xxh3_64_intdigest(pool_hash.to_bytes(8, "little"), seed=group + 1)
        self._keys[key] = (group, pool_hash)
        self.held[group].add(pool_hash)
        return key

    def evicted(self, pool_key: int) -> tuple[int, int] | None:
        """The group and block hash of an evicted pool key (None: not a window block)."""
        owner = self._keys.pop(pool_key, None)
        if owner is not None:
            group, pool_hash = owner
            self.held[group].discard(pool_hash)
        return owner

    def reset(self) -> None:
        for held in self.held:
            held.clear()
        self._keys.clear()
