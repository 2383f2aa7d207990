"""Block hashes of prompts, reusing those of an earlier prompt a new one starts with.

A session's next turn carries the whole previous turn, so most of a prompt's blocks
were hashed when the turn before arrived. ``chain_hashes`` is a pure function and a
block's hash depends only on the blocks up to it (and the parent), so where a prompt
starts with the same blocks as a remembered prompt, under the same parent, it has the
same hashes there: those are copied and only the rest is hashed. Which blocks are the
same is found by comparing bytes, never by trusting a hash.
"""

from __future__ import annotations

from collections import OrderedDict

from router.wire.blocks import TOKEN_BYTES, token_block_hashes

# Prompts remembered, and the bytes they may hold in all.
DEFAULT_CAPACITY = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


class PrefixHashes:
    """``token_block_hashes(prompt, block_tokens, parent)`` for a stream of prompts.

    The latest prompt is remembered per (parent, first block): a conversation's turns
    share their first block, so a turn finds the turn before. At most ``capacity``
    prompts and ``max_bytes`` of them are kept, least recently used dropped first.
    """

    __slots__ = ("_block_bytes", "_bytes", "_seen", "block_tokens", "capacity", "max_bytes")

    def __init__(
        self,
        block_tokens: int,
        capacity: int = DEFAULT_CAPACITY,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.block_tokens = block_tokens
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._block_bytes = block_tokens * TOKEN_BYTES
        self._seen: OrderedDict[tuple[int, bytes], tuple[bytes, list[int]]] = OrderedDict()
        self._bytes = 0

    def hashes(self, prompt: bytes, parent: int = 0) -> list[int]:
        """The hashes of ``prompt``'s full blocks (a list the caller may change)."""
        key = (parent, prompt[: self._block_bytes])
        seen = self._seen.pop(key, None)
        same = 0 if seen is None else self._blocks_in_common(prompt, seen[0])
        if seen is not None and same > 0:
            known = seen[1]
            hashes = known[:same] + token_block_hashes(
                prompt, self.block_tokens, known[same - 1], same
            )
        else:
            hashes = token_block_hashes(prompt, self.block_tokens, parent)
        if seen is not None:
            self._bytes -= len(seen[0])
        if hashes:
            self._seen[key] = (prompt, hashes[:])
            self._bytes += len(prompt)
            while len(self._seen) > self.capacity or self._bytes > self.max_bytes:
                _, (dropped, _) = self._seen.popitem(last=False)
                self._bytes -= len(dropped)
        return hashes

    def _blocks_in_common(self, prompt: bytes, earlier: bytes) -> int:
        """How many leading full blocks ``prompt`` and ``earlier`` share: a binary search
        over byte comparisons (one when the earlier prompt is a prefix, the usual case)."""
        step = self._block_bytes
        view = memoryview(earlier)
        low, high = 0, min(len(earlier), len(prompt)) // step
        if prompt.startswith(view[: high * step]):
            return high
        while low < high - 1:  # the first ``low`` blocks agree, the first ``high`` do not
            middle = (low + high) // 2
            if prompt.startswith(view[: middle * step]):
                low = middle
            else:
                high = middle
        return low
