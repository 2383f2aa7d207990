"""Chained hashes of full token blocks, as vLLM's prefix cache keys them.

``h_i = xxh3_64(block_i, seed=h_{i-1})``: a block's hash names the whole prefix up to
and including it, so two prompts share a cached block only if they share everything
before it too. Only full blocks are hashed; a partial tail block is never cached.
"""

from __future__ import annotations

import xxhash

from bench.tokenizer import TOKEN_BYTES

DEFAULT_BLOCK_TOKENS = 16


def chain_hashes(
    encoded: bytes | bytearray,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    parent: int = 0,
    start_block: int = 0,
) -> list[int]:
    """Hashes of the full blocks of ``encoded`` from ``start_block`` on.

    ``parent`` is the hash of block ``start_block - 1`` (or the seed when starting at 0),
    so a sequence that grows can be hashed incrementally.
    """
    step = block_tokens * TOKEN_BYTES
    digest = xxhash.xxh3_64_intdigest
    hashes: list[int] = []
    view = memoryview(encoded)
    for offset in range(start_block * step, len(encoded) - step + 1, step):
        parent = digest(view[offset : offset + step], parent)
        hashes.append(parent)
    return hashes
