"""KV event encoders as the engines define them, copied from their sources: vLLM 0.33's
(``vllm/distributed/kv_events.py``: tagged maps) are the simulated engine's own, in
``bench/sim/kv_events.py``; vLLM 0.10.2's (positional arrays) and SGLang 0.5.23's
(``sglang/srt/disaggregation/kv_events.py``) are here. Each encodes with
``msgspec.msgpack.Encoder().encode(batch)``, as their publishers do."""

from __future__ import annotations

from typing import Any

import msgspec

from bench.sim.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "encode"]

ENCODER = msgspec.msgpack.Encoder()


class OldKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(OldKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(OldKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldAllBlocksCleared(OldKVCacheEvent, tag="AllBlocksCleared"):
    pass


class SglangEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class SglangKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class SglangBlockStored(SglangKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


def encode(batch: msgspec.Struct) -> bytes:
    return ENCODER.encode(batch)
