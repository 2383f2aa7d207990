"""A stored response's conversation as a prefix key: what a request continuing it
(``previous_response_id``) is keyed from.

The engine renders such a request as the stored conversation (its prompt's messages and
its reply) followed by the new input (``router.apis.responses_chat``). The router never
holds that conversation's text; it keeps, with the response's owner, the chain of the
conversation's blocks and what extending it needs: the bytes after its last full block,
its length, its seed, and how it was keyed (by text or by the model's tokens, in blocks
of how many bytes). A continuation is keyed by extending it with the new input's
canonical bytes, as the whole conversation would have been keyed.

Bounded: at most ``MAX_CHAIN_BLOCKS`` hashes are kept. A longer conversation keeps its
first ones only and is *cut*: a continuation is keyed by them (it matches no further)
and nothing extends them.

``encode``/``decode`` are the compact form the shared state carries (the hashes packed,
8 bytes each); ``decode`` takes whatever Redis holds as untrusted and answers None for
anything a router could not have written.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal

from router.index.prefix import PrefixKey

KeyedBy = Literal["text", "tokens"]
# 16,384 blocks: 262,144 tokens by the model's 16-token blocks, 4 MiB of text by 256-byte
# ones; 128 KiB of hashes.
MAX_CHAIN_BLOCKS = 16_384
_KEYED_BY: tuple[KeyedBy, ...] = ("text", "tokens")
HASH_BYTES = 8
MAX_BLOCK_BYTES = 65_536  # prefix.block_bytes' upper bound
# A conversation longer than any context: a length past it was not written by a router.
MAX_TOTAL_BYTES = 1 << 40
# magic, version, keyed by, whole, block bytes, seed, context, total bytes, hashes, tail
_HEADER = struct.Struct("<2sBBBIQQQII")
_MAGIC = b"kc"
_VERSION = 1
MAX_ENCODED_BYTES = _HEADER.size + MAX_CHAIN_BLOCKS * HASH_BYTES + MAX_BLOCK_BYTES


@dataclass(frozen=True, slots=True)
class StoredChain:
    packed: bytes  # the block hashes, HASH_BYTES each, little-endian
    tail: bytes  # canonical bytes after the last full block (empty when cut)
    total_bytes: int  # the conversation's canonical bytes
    seed: int  # the chain's seed: the model and the cache salt
    # What a continuation must share with the conversation for its prompt to extend it
    # (router.apis.views.ResponsesLink.context).
    context: int
    block_bytes: int
    keyed_by: KeyedBy
    whole: bool = True  # False: cut at MAX_CHAIN_BLOCKS; nothing extends it

    @classmethod
    def of(
        cls,
        key: PrefixKey,
        keyed_by: KeyedBy,
        block_bytes: int,
        context: int,
        whole: bool = True,
        max_blocks: int = MAX_CHAIN_BLOCKS,
    ) -> StoredChain:
        """``key``'s chain, cut to its first ``max_blocks`` blocks if longer."""
        hashes, tail = key.hashes, key.tail
        if len(hashes) > max_blocks or not whole:
            hashes, tail, whole = hashes[:max_blocks], b"", False
        packed = struct.pack(f"<{len(hashes)}Q", *hashes)
        return cls(packed, tail, key.total_bytes, key.seed, context, block_bytes, keyed_by, whole)

    @property
    def blocks(self) -> int:
        return len(self.packed) // HASH_BYTES

    @property
    def size_bytes(self) -> int:
        """What it holds, for the bound on all of them (``ResponseOwners``)."""
        return len(self.packed) + len(self.tail)

    def key(self) -> PrefixKey:
        """The conversation's key (of its first blocks alone, when cut)."""
        hashes = struct.unpack(f"<{self.blocks}Q", self.packed)
        return PrefixKey(hashes, self.tail, self.seed, self.total_bytes)

    def fits(self, seed: int, context: int, block_bytes: int) -> bool:
        """Whether a request of ``seed`` and ``context``, keyed in blocks of
        ``block_bytes``, continues this conversation's chain."""
        return (seed, context, block_bytes) == (self.seed, self.context, self.block_bytes)

    def encode(self) -> bytes:
        header = _HEADER.pack(
            _MAGIC,
            _VERSION,
            _KEYED_BY.index(self.keyed_by),
            self.whole,
            self.block_bytes,
            self.seed,
            self.context,
            self.total_bytes,
            self.blocks,
            len(self.tail),
        )
        return header + self.packed + self.tail

    @classmethod
    def decode(cls, raw: bytes) -> StoredChain | None:
        """What ``encode`` wrote; None for anything else (another version's, garbled,
        longer than a router writes)."""
        if not _HEADER.size <= len(raw) <= MAX_ENCODED_BYTES:
            return None
        fields = _HEADER.unpack_from(raw)
        magic, version, keyed_by, whole, block_bytes, seed, context, total, blocks, tail = fields
        if (magic, version) != (_MAGIC, _VERSION) or keyed_by >= len(_KEYED_BY) or whole > 1:
            return None
        if not 0 < block_bytes <= MAX_BLOCK_BYTES or blocks > MAX_CHAIN_BLOCKS:
            return None
        if tail >= block_bytes or (tail and not whole):
            return None
        if len(raw) != _HEADER.size + blocks * HASH_BYTES + tail:
            return None
        if not blocks * block_bytes + tail <= total <= MAX_TOTAL_BYTES:
            return None
        if whole and total != blocks * block_bytes + tail:
            return None
        end = _HEADER.size + blocks * HASH_BYTES
        packed, tail_bytes = raw[_HEADER.size : end], raw[end:]
        return cls(
            packed, tail_bytes, total, seed, context, block_bytes, _KEYED_BY[keyed_by], bool(whole)
        )
