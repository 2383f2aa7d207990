"""Engines' KV event messages decoded, and the router's own hashes for their blocks."""

from __future__ import annotations

import contextlib
import hashlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.index.chains import EngineChains
from router.index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedEvents,
    decode_batch,
    read_message,
)
from router.index.prefix import chain_seed, prefix_key
from router.kv_events.slices import event_slices
from router.wire.blocks import token_bytes
from tests import engine_kv_events as engine

BLOCK = 4


def sha(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()


def stored_v033(
    hashes: list[bytes | int], parent: bytes | int | None, tokens: list[int], **kw: object
) -> engine.BlockStored:
    return engine.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        **kw,  # type: ignore[arg-type]
    )


def test_vllm_033_tagged_maps_decode_with_their_salt_from_the_first_blocks_extra_keys() -> None:
    payload = engine.encode(
        engine.EventBatch(
            ts=12.5,
            events=[
                stored_v033(
                    [sha(1), sha(2)],
                    None,
                    list(range(8)),
                    extra_keys=[("tenant-a",), None],
                    group_idx=0,
                ),
                engine.BlockRemoved(block_hashes=[sha(9)], medium="GPU"),
                engine.AllBlocksCleared(),
            ],
            data_parallel_rank=1,
        )
    )
    batch = decode_batch(payload)
    assert batch.ts == 12.5 and batch.rank == 1
    assert batch.events == (
        BlockStored((sha(1), sha(2)), None, tuple(range(8)), BLOCK, None, "GPU", "tenant-a", 0),
        BlockRemoved((sha(9),), "GPU"),
        AllBlocksCleared(),
    )


def test_a_lora_name_leads_the_extra_keys_and_is_not_taken_for_the_salt() -> None:
    event = engine.BlockStored(
        block_hashes=[7],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=BLOCK,
        lora_id=3,
        medium="GPU",
        lora_name="sql-adapter",
        extra_keys=[("sql-adapter", "s1")],
    )
    (decoded,) = decode_batch(engine.encode(engine.EventBatch(ts=1.0, events=[event]))).events
    assert isinstance(decoded, BlockStored)
    assert (decoded.lora_name, decoded.cache_salt) == ("sql-adapter", "s1")


def test_vllm_010_positional_arrays_decode() -> None:
    payload = engine.encode(
        engine.EventBatch(
            ts=3.0,
            events=[
                engine.OldBlockStored([11, 12], 10, list(range(8)), BLOCK, None, None),
                engine.OldBlockRemoved([11], None),
                engine.OldAllBlocksCleared(),
            ],
        )
    )
    batch = decode_batch(payload)
    assert batch.rank is None
    assert batch.events == (
        BlockStored((11, 12), 10, tuple(range(8)), BLOCK),
        BlockRemoved((11,)),
        AllBlocksCleared(),
    )


def test_the_cpu_tier_s_events_are_kept_apart_and_storage_s_left_out() -> None:
    """vLLM's offloading connector announces blocks stored to and removed from CPU memory
    (by default as placeholders: the hash alone, no tokens, block size 0) and storage:
    the CPU tier's are kept, spelled "CPU" whatever the connector's case, placeholders
    allowed there alone; storage's are left out."""
    offloaded = stored_v033([sha(1)], None, list(range(4)))
    placeholder = engine.BlockStored(
        block_hashes=[sha(5)],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    payload = engine.encode(
        engine.EventBatch(
            ts=1.0,
            events=[
                stored_v033([sha(2)], None, list(range(4))),
                msgspec.structs.replace(offloaded, medium="cpu"),
                placeholder,
                msgspec.structs.replace(placeholder, medium="STORAGE"),
                engine.BlockRemoved(block_hashes=[sha(2)], medium="cpu"),
                engine.BlockRemoved(block_hashes=[sha(3)], medium="STORAGE"),
                engine.BlockRemoved(block_hashes=[sha(4)], medium="GPU"),
            ],
        )
    )
    events = decode_batch(payload).events
    assert events == (
        BlockStored((sha(2),), None, tuple(range(4)), BLOCK, None, "GPU", None, None),
        BlockStored((sha(1),), None, tuple(range(4)), BLOCK, None, "CPU", None, None),
        BlockStored((sha(5),), None, (), 0, None, "CPU", None, None),
        BlockRemoved((sha(2),), "CPU"),
        BlockRemoved((sha(4),), "GPU"),
    )
    assert [e.offloaded for e in events if not isinstance(e, AllBlocksCleared)] == [
        False,
        True,
        True,
        True,
        False,
    ]
    old = engine.encode(
        engine.EventBatch(
            ts=2.0,
            events=[
                engine.OldBlockStored([11], None, [], 0, None, "CPU"),
                engine.OldBlockRemoved([11], "Storage"),
                engine.OldBlockRemoved([12], None),
            ],
        )
    )
    assert decode_batch(old).events == (
        BlockStored((11,), None, (), 0, None, "CPU"),
        BlockRemoved((12,)),
    )


@pytest.mark.parametrize("medium", ["GPU", None])
def test_a_placeholder_on_the_gpu_is_malformed(medium: str | None) -> None:
    placeholder = engine.BlockStored(
        block_hashes=[sha(5)],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )
    with pytest.raises(MalformedEvents, match="placeholder"):
        decode_batch(engine.encode(engine.EventBatch(ts=1.0, events=[placeholder])))


def test_sglang_batches_carry_the_salt_and_the_attention_dp_rank() -> None:
    payload = engine.encode(
        engine.SglangEventBatch(
            ts=2.0,
            events=[engine.SglangBlockStored([5], None, [9, 9, 9, 9], BLOCK, None, cache_salt="t")],
            attn_dp_rank=2,
        )
    )
    batch = decode_batch(payload)
    assert batch.rank == 2
    assert batch.events == (BlockStored((5,), None, (9, 9, 9, 9), BLOCK, cache_salt="t"),)


def test_a_message_is_topic_sequence_and_payload() -> None:
    message = read_message([b"kv", (41).to_bytes(8, "big"), b"x"])
    assert (message.topic, message.seq, message.payload, message.ends_replay) == (
        b"kv",
        41,
        b"x",
        False,
    )
    assert read_message([b"", (-1).to_bytes(8, "big", signed=True), b""]).ends_replay
    with pytest.raises(MalformedEvents):
        read_message([b"kv", b"\x00" * 8])
    with pytest.raises(MalformedEvents):
        read_message([b"kv", b"\x01", b"x"])


def _raw(events: list[object], ts: object = 1.0) -> bytes:
    return msgspec.msgpack.encode([ts, events])


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never used in msgpack
        msgspec.msgpack.encode({"ts": 1}),
        msgspec.msgpack.encode([1.0]),
        _raw([], ts="now"),
        _raw([{"type": "Mystery"}]),
        _raw([42]),
        _raw(
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1],
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3],
                    "block_size": 4,
                }
            ]
        ),  # a short block
        _raw(
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1],
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3, True],
                    "block_size": 4,
                }
            ]
        ),
        _raw(
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1],
                    "parent_block_hash": None,
                    "token_ids": [],
                    "block_size": 0,
                }
            ]
        ),
        _raw(
            [
                {
                    "type": "BlockStored",
                    "block_hashes": ["a"],
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3, 4],
                    "block_size": 4,
                }
            ]
        ),
        _raw([{"type": "BlockRemoved", "block_hashes": None}]),
        _raw([["BlockRemoved", [1], None, "extra"]]),
    ],
)
def test_what_is_not_a_batch_is_refused_as_malformed(payload: bytes) -> None:
    with pytest.raises(MalformedEvents):
        decode_batch(payload)


@given(st.binary(max_size=200))
def test_no_bytes_escape_decoding_as_anything_but_a_batch_or_malformed(payload: bytes) -> None:
    with contextlib.suppress(MalformedEvents):
        decode_batch(payload)


def test_the_router_names_announced_blocks_as_it_keys_the_same_tokens() -> None:
    tokens = list(range(100, 124))  # six blocks, announced in two events
    chains = EngineChains("qwen3", max_blocks=100)
    first, _ = chains.stored(
        BlockStored((sha(1), sha(2)), None, tuple(tokens[:8]), BLOCK, cache_salt="s")
    )
    rest, _ = chains.stored(
        BlockStored(tuple(sha(i) for i in (3, 4, 5, 6)), sha(2), tuple(tokens[8:]), BLOCK)
    )
    key = prefix_key(token_bytes(tokens), BLOCK * 4, chain_seed("qwen3", "s"))
    assert first + rest == list(key.hashes)
    unsalted = prefix_key(token_bytes(tokens), BLOCK * 4, chain_seed("qwen3"))
    assert not set(first) & set(unsalted.hashes)


def test_an_engine_block_of_several_router_blocks_is_named_by_each_of_them() -> None:
    tokens = list(range(100, 124))  # three engine blocks of 8 tokens: six router blocks
    chains = EngineChains("qwen3", max_blocks=100, block_tokens=BLOCK)
    first, _ = chains.stored(BlockStored((sha(1),), None, tuple(tokens[:8]), 2 * BLOCK))
    rest, _ = chains.stored(BlockStored((sha(2), sha(3)), sha(1), tuple(tokens[8:]), 2 * BLOCK))
    key = prefix_key(token_bytes(tokens), BLOCK * 4, chain_seed("qwen3"))
    assert first + rest == list(key.hashes)
    assert chains.removed((sha(3),)) == list(key.hashes[4:])
    with pytest.raises(ValueError, match="not a whole number"):
        chains.stored(BlockStored((sha(4),), None, tuple(tokens[:6]), 6))


def test_the_map_is_bounded_by_router_blocks_whatever_block_size_the_engine_claims() -> None:
    chains = EngineChains("m", max_blocks=10, block_tokens=BLOCK)
    big = 8 * BLOCK  # eight router blocks an engine block
    for i in range(3):
        chains.stored(BlockStored((sha(i),), None, tuple(range(i, i + big)), big))
        assert chains.router_blocks <= 10
    assert len(chains) == 1  # the newest engine block alone fits


def test_blocks_whose_parent_was_never_announced_are_skipped() -> None:
    chains = EngineChains("m", max_blocks=10)
    assert chains.stored(BlockStored((sha(2),), sha(1), (1, 2, 3, 4), BLOCK)) == ([], [])
    assert chains.orphans == 1 and len(chains) == 0


def test_a_router_hash_is_held_while_any_engine_block_holds_it() -> None:
    chains = EngineChains("m", max_blocks=10)
    (ours,), _ = chains.stored(BlockStored((sha(1),), None, (1, 2, 3, 4), BLOCK, group_idx=0))
    assert chains.stored(BlockStored((sha(2),), None, (1, 2, 3, 4), BLOCK, group_idx=1)) == ([], [])
    assert chains.removed((sha(1),)) == []
    assert chains.removed((sha(2),)) == [ours]
    assert chains.removed((sha(2),)) == []


def test_the_map_is_bounded_and_gives_back_what_it_drops() -> None:
    chains = EngineChains("m", max_blocks=2)
    hashes = [
        chains.stored(BlockStored((sha(i),), None, (i, i, i, i), BLOCK))[0][0] for i in range(2)
    ]
    added, dropped = chains.stored(BlockStored((sha(5),), None, (5, 5, 5, 5), BLOCK))
    assert len(added) == 1 and dropped == [hashes[0]] and len(chains) == 2


def test_a_block_stored_twice_is_held_until_both_copies_are_removed() -> None:
    chains = EngineChains("m", max_blocks=10)
    block = BlockStored((sha(1),), None, (1, 2, 3, 4), BLOCK)
    (ours,), _ = chains.stored(block)
    assert chains.stored(block) == ([], [])
    assert chains.removed((sha(1),)) == []
    assert chains.removed((sha(1),)) == [ours]
    assert len(chains) == 0


def test_a_long_batch_is_applied_in_slices_that_name_the_same_blocks() -> None:
    tokens = list(range(1000, 1000 + 10 * BLOCK))
    stored = BlockStored(tuple(sha(i) for i in range(10)), None, tuple(tokens), BLOCK)
    removed = BlockRemoved(tuple(sha(i) for i in range(6, 10)))
    slices = list(event_slices([stored, removed, AllBlocksCleared()], limit=3))
    assert all(
        sum(1 if isinstance(e, AllBlocksCleared) else len(e.block_hashes) for e in piece) <= 3
        for piece in slices
    )
    whole, sliced = EngineChains("m", max_blocks=100), EngineChains("m", max_blocks=100)
    added, _ = whole.stored(stored)
    pieces = [e for piece in slices for e in piece]
    added_in_slices = [h for e in pieces if isinstance(e, BlockStored) for h in sliced.stored(e)[0]]
    assert added_in_slices == added
    gone = [
        h for e in pieces if isinstance(e, BlockRemoved) for h in sliced.removed(e.block_hashes)
    ]
    assert gone == whole.removed(removed.block_hashes) and len(gone) == 4
    assert isinstance(pieces[-1], AllBlocksCleared)
