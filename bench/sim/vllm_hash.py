"""vLLM's prefix-cache block hashes (v0.33: ``vllm/utils/hashing.py`` and
``vllm/v1/core/kv_cache_utils.py``), for the KV events the simulated engine publishes.

A block's hash is ``hash_fn((parent_hash, tuple(block_token_ids), extra_keys))``, the
first block's parent being ``NONE_HASH = hash_fn(seed)``. The seed is ``PYTHONHASHSEED``
when set, else ``"vllm-none-hash"`` for the sha256 algorithms and 32 random bytes (hex)
per process for the xxhash ones. Extra keys, tagged, in vLLM's order: the LoRA
``("lora", name, path)``, then ``("cache_salt", salt)`` in the first block only; ``None``
when there are none. Events carry the bytes, or with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` their last 8 bytes as an integer.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cbor2
import xxhash

HashFn = Callable[[Any], bytes]

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def xxhash_pickle(value: Any) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(value: Any) -> bytes:
    return xxhash.xxh3_128_digest(cbor2.dumps(value, canonical=True))


# --prefix-caching-hash-algo's choices.
HASH_FUNCTIONS: Mapping[str, HashFn] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash_pickle,
    "xxhash_cbor": xxhash_cbor,
}
_NOT_COLLISION_RESISTANT = frozenset({"xxhash", "xxhash_cbor"})


def none_hash_seed(algorithm: str, environ: Mapping[str, str] = os.environ) -> str:
    seed = environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algorithm in _NOT_COLLISION_RESISTANT:
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED


def block_extra_keys(
    block_index: int, cache_salt: str | None, lora: tuple[str, str] | None = None
) -> tuple[Any, ...] | None:
    """A block's tagged extra keys (``generate_block_hash_extra_keys`` for a text prompt)."""
    keys: list[Any] = []
    if lora is not None:
        keys.append(("lora", lora[0], lora[1]))
    if block_index == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


class BlockHasher:
    """One engine's hash function and ``NONE_HASH``."""

    __slots__ = ("hash_fn", "none_hash")

    def __init__(self, algorithm: str = "sha256", seed: str | None = None) -> None:
        if algorithm not in HASH_FUNCTIONS:
            raise ValueError(f"unknown prefix caching hash algorithm {algorithm!r}")
        self.hash_fn = HASH_FUNCTIONS[algorithm]
        self.none_hash = self.hash_fn(none_hash_seed(algorithm) if seed is None else seed)

    def block(
        self,
        parent: bytes | None,
        token_ids: Sequence[int],
        extra_keys: tuple[Any, ...] | None = None,
    ) -> bytes:
        """``hash_block_tokens``: a full block's hash under its parent's."""
        return self.hash_fn((parent or self.none_hash, tuple(token_ids), extra_keys))


def external_hash(block_hash: bytes, as_int: bool = False) -> bytes | int:
    """The hash as events carry it (``maybe_convert_block_hash``)."""
    if not as_int:
        return block_hash
    return int.from_bytes(block_hash, byteorder="big") & ((1 << 64) - 1)


def event_extra_keys(keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """A block's extra keys as events publish them, untagged (``to_event_extra_keys``)."""
    if keys is None:
        return None
    return tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)
