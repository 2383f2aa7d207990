"""KV events published as SGLang 0.5.23 publishes them (the PyPI release's
``sglang/srt/disaggregation/kv_events.py``, ``sglang/srt/mem_cache/events.py``,
``sglang/srt/mem_cache/utils.py`` and ``mem_cache/cpp_utils/hash_binding.cpp``).

* The Structs: a batch is the array ``[ts, events, attn_dp_rank]``, the rank always
  written (SGLang's ``EventBatch`` has no ``omit_defaults``); each event a map tagged
  ``type`` with defaults omitted, as vLLM's. ``BlockStored`` has no ``extra_keys`` or
  ``group_idx``, always writes ``lora_id`` (nil: it has no default) and carries the
  request's ``cache_salt``; ``BlockRemoved`` is ``block_hashes`` and ``medium``.
* The hashes (``get_hash_str`` over pages of ``page_size`` tokens): a page's digest is
  ``sha256(parent digest + the page's ids as little-endian uint32)``, the first page of a
  chain with no parent digest, or, for a salted request, with
  ``sha256(b"sglang-cache-salt-v1\\0" + salt)`` as its parent. An event carries a
  digest's first 8 bytes as a signed big-endian int64 (``hash_str_to_int64``).
  The stand-in's tokens are 4 little-endian bytes each, so a page's bytes are hashed as
  they are. With ``"format": "dynamo"`` a salted chain's hashes are namespaced once more
  (``namespaced_block_hash``).
* The publisher is vLLM's (``bench/sim/kv_events.py``), which SGLang's matches frame for
  frame (0.5.23's replay frames carry the topic too); it stamps ``attn_dp_rank``, and
  binds ``0.0.0.0`` endpoints and any endpoint when ``bind`` is true.
* ``SglangKVEventsConfig.from_cli``: ``--kv-events-config '<json>'`` with SGLang's field
  names; like SGLang's pydantic model it ignores fields it does not know, so vLLM's
  ``enable_kv_cache_events`` is harmless, and it publishes only with ``"publisher":
  "zmq"``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import Any, Literal

import msgspec
import orjson

from bench.sim.kv_events import ZmqEventPublisher

Format = Literal["default", "dynamo"]


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# -- hashes ---------------------------------------------------------------------------

_SALT_SEED_TAG = b"sglang-cache-salt-v1\0"  # mem_cache/utils.py compute_node_event_hash_values
_NAMESPACE_SEED_TAG = b"sglang-kv-event-namespace-v1"  # disaggregation/kv_events.py


def salt_seed(cache_salt: str | None) -> bytes | None:
    """The parent digest of a chain's first page: none, or the salt's."""
    if cache_salt is None:
        return None
    return hashlib.sha256(_SALT_SEED_TAG + cache_salt.encode()).digest()


def page_digest(parent: bytes | None, page: bytes) -> bytes:
    """``hash_page`` of hash_binding.cpp: ``page`` is the ids as little-endian uint32."""
    return hashlib.sha256(parent + page if parent is not None else page).digest()


def event_hash(digest: bytes) -> int:
    """``hash_str_to_int64`` of the digest's hex: its first 16 hex digits, signed."""
    return int.from_bytes(digest[:8], "big", signed=True)


def namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """``kv_event_namespace_seed``: the dynamo format's per-namespace seed."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(_NAMESPACE_SEED_TAG)
    # SGLang's presence byte and length prefix keep ("a", "bc") and ("ab", "c") apart.
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode()
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.digest()


def namespaced_block_hash(block_hash: int, seed: bytes | None) -> int:
    if seed is None:
        return block_hash
    digest = hashlib.sha256(seed + block_hash.to_bytes(8, "big", signed=True)).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


# -- configuration and publisher --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SglangKVEventsConfig:
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    bind: bool | None = None  # None: bind wildcard, ipc and inproc endpoints
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    format: Format = "default"

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"Unknown event publisher {self.publisher!r}")
        if self.format not in ("default", "dynamo"):
            raise ValueError(f"format must be 'default' or 'dynamo', not {self.format!r}")
        if self.buffer_steps < 1 or self.hwm < 0 or self.max_queue_size < 1:
            raise ValueError("buffer_steps and max_queue_size must be >= 1, hwm >= 0")

    @property
    def publishes(self) -> bool:
        return self.publisher == "zmq"

    def open_publisher(self, data_parallel_rank: int = 0) -> ZmqEventPublisher:
        return SglangZmqEventPublisher(self, data_parallel_rank)

    @classmethod
    def from_cli(cls, text: str) -> SglangKVEventsConfig:
        raw = orjson.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config is a JSON object")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


class SglangZmqEventPublisher(ZmqEventPublisher):
    def __init__(self, config: SglangKVEventsConfig, attn_dp_rank: int = 0) -> None:
        self._bind = config.bind  # read by _binds, from the base's __init__
        super().__init__(config, attn_dp_rank)

    def _stamp_rank(self, batch: msgspec.Struct) -> None:
        if isinstance(batch, EventBatch) and batch.attn_dp_rank is None:
            batch.attn_dp_rank = self.data_parallel_rank

    def _binds(self, endpoint: str) -> bool:
        if self._bind is not None:
            return self._bind
        wildcards = ("*", "::", "0.0.0.0")
        return any(w in endpoint for w in wildcards) or endpoint.startswith(("ipc://", "inproc://"))
