"""Token ids as bytes, and the chained hashes of full blocks of them.

``h_i = xxh3_64(block_i, seed=h_{i-1})``: a block's hash names the whole prefix up to
and including it, so two prompts share a cached block only if they share everything
before it too. Only full blocks are hashed; a partial tail block is never cached. The
router keys prompts so (``router.index.prefix``), and the simulated engine keys its cache so
(``bench.sim``).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

import xxhash

TOKEN_BYTES = 4  # a token id: 4 little-endian bytes
DEFAULT_BLOCK_TOKENS = 16  # vLLM's default block size

_digest = xxhash.xxh3_64_intdigest


def token_bytes(ids: Iterable[int]) -> bytes:
    """Token ids as bytes, ``TOKEN_BYTES`` little-endian bytes each, built at C speed: a
    body can hold millions of them."""
    packed = ids if isinstance(ids, array) and ids.typecode == "I" else array("I", ids)
    if sys.byteorder == "big":
        packed = array("I", packed)
        packed.byteswap()
    return packed.tobytes()


def chain_hashes(
    data: bytes | bytearray, block_bytes: int, parent: int, start_block: int = 0
) -> list[int]:
    """Hashes of the full ``block_bytes`` blocks of ``data`` from ``start_block`` on;
    ``parent`` is the hash of block ``start_block - 1`` (the chain's seed at 0), so a
    sequence that grows can be hashed as it grows."""
    hashes: list[int] = []
    view = memoryview(data)
    for offset in range(start_block * block_bytes, len(data) - block_bytes + 1, block_bytes):
        parent = _digest(view[offset : offset + block_bytes], parent)
        hashes.append(parent)
    return hashes


def token_block_hashes(
    encoded: bytes | bytearray,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    parent: int = 0,
    start_block: int = 0,
) -> list[int]:
    """``chain_hashes`` over blocks of ``block_tokens`` token ids."""
    return chain_hashes(encoded, block_tokens * TOKEN_BYTES, parent, start_block)
