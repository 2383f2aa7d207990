"""The simulated engine's KV events with ``flavor="sglang"``, as SGLang 0.5.23 publishes
them: its batch shape and Structs, its page hashes, the request's ``cache_salt``; read by
the router's decoder, and, chained by ``router/kv_events``, naming exactly the blocks the
pool holds."""

from __future__ import annotations

import asyncio
import hashlib
import random
from typing import Any

import httpx
import msgspec
import pytest
import xxhash

from bench.ports import free_port
from bench.sim.config import EngineConfig
from bench.sim.kv_cache import BlockPool
from bench.sim.kv_events import KVEventsConfig
from bench.sim.request import SimRequest
from bench.sim.scheduler import Scheduler
from bench.sim.sglang_kv_event_log import SglangEngineEvents
from bench.sim.sglang_kv_events import (
    BlockStored,
    Format,
    KVEventBatch,
    SglangKVEventsConfig,
    namespace_seed,
    namespaced_block_hash,
)
from router.index import events as wire
from router.wire.blocks import token_block_hashes
from tests.conftest import TEST_MODEL, EngineFactory, engine_config
from tests.engine_kv_events import SglangBlockStored, SglangEventBatch, encode
from tests.sim.test_sim_kv_event_log import BLOCK, EventReader, run, tokens
from tests.sim.test_sim_kv_events import replay_from

TOKEN = int.from_bytes(b"abcd", "little")


def sglang_hashes(pages: list[bytes], salt: str | None = None) -> list[int]:
    """SGLang's chain, written out from its source (mem_cache/utils.py, hash_binding.cpp):
    sha256 over the parent digest and the page's little-endian uint32 ids; a salt's
    chain starts from sha256("sglang-cache-salt-v1\\0" + salt); the first 8 bytes, signed."""
    parent = hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).digest() if salt else b""
    out = []
    for page in pages:
        parent = hashlib.sha256(parent + page).digest()
        out.append(int.from_bytes(parent[:8], "big", signed=True))
    return out


async def test_a_served_engine_announces_a_prompts_blocks_as_sglang_does(
    engine_factory: EngineFactory,
) -> None:
    port, replay = free_port(), free_port()
    config = SglangKVEventsConfig(
        publisher="zmq", endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}"
    )
    prompt = "abcd" * 40  # 40 stand-in tokens of 4 bytes: two full pages of 16
    async with engine_factory(kv_events=config, flavor="sglang") as sim:
        async with httpx.AsyncClient(base_url=sim.url) as client:
            for salt in (None, "tenant-a"):
                body: dict[str, Any] = {"model": TEST_MODEL, "prompt": prompt, "max_tokens": 1}
                if salt:
                    body["cache_salt"] = salt
                answer = await client.post("/v1/completions", json=body)
                assert answer.status_code == 200, answer.text
        messages = await asyncio.to_thread(replay_from, replay, 0)
    batches = [wire.decode_batch(m.payload) for m in messages]
    stored = [e for b in batches for e in b.events if isinstance(e, wire.BlockStored)]
    assert {b.rank for b in batches} == {0}  # from attn_dp_rank
    # A new SGLang process's cache resets itself: its first batch says so.
    assert isinstance(batches[0].events[0], wire.AllBlocksCleared)
    assert [s.cache_salt for s in stored] == [None, "tenant-a"]
    page = b"abcd" * 16
    for event in stored:
        assert event.parent_block_hash is None and event.block_size == 16
        assert event.token_ids == (TOKEN,) * 32 and event.medium == "GPU"
        assert list(event.block_hashes) == sglang_hashes([page, page], event.cache_salt)
    # The batch is [ts, events, attn_dp_rank], the rank always written; the event is
    # SGLang's tagged map, lora_id written as nil, no vLLM-only field.
    raw = msgspec.msgpack.decode(messages[0].payload)
    assert len(raw) == 3 and raw[2] == 0
    raws = (e for m in messages for e in msgspec.msgpack.decode(m.payload)[1])
    first = next(e for e in raws if e["type"] == "BlockStored")
    assert "lora_id" in first and first["lora_id"] is None
    assert not {"extra_keys", "group_idx", "lora_name", "session_id"} & set(first)


def test_the_structs_encode_as_sglangs_own() -> None:
    """Byte for byte as tests/engine_kv_events.py's copy of SGLang 0.5.23's Structs."""
    fields: dict[str, Any] = {
        "block_hashes": [-5, 7],
        "parent_block_hash": 3,
        "token_ids": [1, 2],
        "block_size": 1,
        "lora_id": None,
        "medium": "GPU",
        "cache_salt": "s",
    }
    ours = KVEventBatch(ts=1.5, events=[BlockStored(**fields)], attn_dp_rank=0)
    theirs = SglangEventBatch(ts=1.5, events=[SglangBlockStored(**fields)], attn_dp_rank=0)
    assert encode(ours) == encode(theirs)


def test_the_config_is_sglangs_and_only_an_sglang_engine_takes_it() -> None:
    # SGLang's pydantic model ignores fields it does not know (the fleet's vLLM flag).
    config = SglangKVEventsConfig.from_cli(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:1", '
        '"bind": true, "format": "dynamo"}'
    )
    assert config.publishes and config.bind and config.format == "dynamo"
    assert not SglangKVEventsConfig.from_cli('{"endpoint": "tcp://*:1"}').publishes
    with pytest.raises(ValueError, match="publisher"):
        SglangKVEventsConfig(publisher="kafka")
    with pytest.raises(ValueError, match="SglangKVEventsConfig"):
        engine_config(flavor="sglang", kv_events=KVEventsConfig(enable_kv_cache_events=True))
    assert isinstance(engine_config(flavor="sglang", kv_events=config), EngineConfig)


class Payloads:
    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.sent: list[bytes] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.sent.append(self.encoder.encode(batch))


def request(rng: random.Random, n: int, prompt: bytes, salt: str | None) -> SimRequest:
    parent = xxhash.xxh3_64_intdigest(salt.encode()) if salt else 0
    output = rng.randrange(1, 12)
    return SimRequest(
        f"r{n}", prompt, output, 0.0, BLOCK, random.Random(n), parent, "length", None, salt
    )


def test_the_events_name_exactly_the_blocks_the_pool_holds() -> None:
    rng = random.Random(7)
    pool = BlockPool(num_blocks=60, block_tokens=BLOCK)
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    sink = Payloads()
    scheduler.publish_kv_events(SglangEngineEvents(sink, BLOCK))
    reader = EventReader()
    system = tokens(rng, 22)
    sessions = [(system + tokens(rng, 5), s) for s in [None, None, None, None, "a", "b"]]
    probes: list[tuple[bytes, str | None]] = []
    counter = checked = partial = 0
    for turn in range(8):
        if turn == 5:  # SGLang's flush_cache: AllBlocksCleared with the next step
            assert scheduler.reset_prefix_cache() == (True, [])
        batch = []
        for i, (history, salt) in enumerate(sessions):
            if rng.random() >= 0.4:
                counter += 1
                batch.append((i, request(rng, counter, history, salt)))
        run(scheduler, [r for _, r in batch])
        for i, done in batch:
            history, salt = sessions[i]
            reply = bytes(done.output)
            sessions[i] = (history + reply + tokens(rng, rng.randrange(3, 9)), salt)
            probes.append((done.prompt + reply, salt))
        reader.catch_up(sink.sent)
        for prompt, salt in probes:
            parent = xxhash.xxh3_64_intdigest(salt.encode()) if salt else 0
            held = len(pool.cached_prefix(token_block_hashes(prompt, BLOCK, parent), 10_000))
            assert reader.match(prompt, salt) == held
            checked += 1
            partial += 0 < held < len(prompt) // (4 * BLOCK)
    events = [e for p in sink.sent for e in wire.decode_batch(p).events]
    removals = [e for e in events if isinstance(e, wire.BlockRemoved)]
    salted = sum(reader.match(p, salt) > 0 for p, salt in probes if salt)
    # Eviction (a step's removals in one event, as SGLang coalesces them), prefixes held
    # in part and salted prompts held were all seen.
    assert checked > 50 and partial > 10 and salted > 0
    assert (
        sum(len(e.block_hashes) for e in removals) > 20
        and max(len(e.block_hashes) for e in removals) > 1
    )


def test_the_dynamo_format_namespaces_only_salted_chains() -> None:
    prompt = tokens(random.Random(1), 3 * BLOCK)
    published: dict[str, list[BlockStored]] = {}
    formats: tuple[Format, ...] = ("default", "dynamo")
    for format in formats:
        pool = BlockPool(num_blocks=20, block_tokens=BLOCK)
        scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
        sink = Payloads()
        scheduler.publish_kv_events(SglangEngineEvents(sink, BLOCK, format))
        rng = random.Random(2)
        run(scheduler, [request(rng, 1, prompt, None), request(rng, 2, prompt, "t")])
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        published[format] = [
            e for p in sink.sent for e in decoder.decode(p).events if isinstance(e, BlockStored)
        ]
    plain, salted = published["default"]
    assert published["dynamo"][0] == plain
    seed = namespace_seed(None, "t")
    assert published["dynamo"][1].block_hashes == [
        namespaced_block_hash(h, seed) for h in salted.block_hashes
    ]
