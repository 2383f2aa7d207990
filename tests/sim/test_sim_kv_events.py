"""The simulated engine's KV event publisher, as vLLM's: real ZMQ sockets over loopback,
read by the router's decoder."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq

from bench.ports import free_port
from bench.sim.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    ZmqEventPublisher,
    offset_endpoint_port,
)
from bench.sim.tokenize import token_ids
from bench.sim.vllm_hash import BlockHasher
from bench.textgen import text_for
from bench.tokenizer import encode_piece
from router.index import events as wire
from tests.conftest import TEST_MODEL, EngineFactory

WAIT_MS = 5000


def stored(n: int) -> BlockStored:
    return BlockStored(
        block_hashes=[n.to_bytes(32, "big")],
        parent_block_hash=None,
        token_ids=[n] * 16,
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


@pytest.fixture
def publisher() -> Iterator[tuple[ZmqEventPublisher, int, int]]:
    port, replay = free_port(), free_port()
    config = KVEventsConfig.from_cli(
        f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}",'
        f' "replay_endpoint": "tcp://*:{replay}", "buffer_steps": 3, "topic": "kv"}}'
    )
    pub = ZmqEventPublisher(config)
    yield pub, port, replay
    pub.shutdown()


def test_batches_go_out_in_sequence_and_a_replay_returns_the_buffered_ones(
    publisher: tuple[ZmqEventPublisher, int, int],
) -> None:
    pub, port, replay_port = publisher
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        # A subscriber misses what was sent before it joined (ZMQ's slow joiner):
        # publish until one arrives, as an engine's steps would.
        sent = 0
        while True:
            pub.publish(KVEventBatch(ts=float(sent), events=[stored(sent)]))
            sent += 1
            if sub.poll(100):
                break
            assert sent < 100, "the subscriber never received a batch"
        first = wire.read_message(sub.recv_multipart())
        pub.publish(KVEventBatch(ts=99.0, events=[BlockRemoved(block_hashes=[b"x"], medium="GPU")]))
        pub.publish(KVEventBatch(ts=100.0, events=[AllBlocksCleared()]))
        received = [first]
        while len(received) < sent - first.seq + 2:
            assert sub.poll(WAIT_MS)
            received.append(wire.read_message(sub.recv_multipart()))
    finally:
        sub.close(linger=0)
    assert [m.seq for m in received] == list(range(first.seq, sent + 2))
    assert {m.topic for m in received} == {b"kv"}
    assert wire.decode_batch(received[-2].payload).events == (wire.BlockRemoved((b"x",), "GPU"),)
    last = wire.decode_batch(received[-1].payload)
    assert last.events == (wire.AllBlocksCleared(),) and last.rank == 0
    decoded = wire.decode_batch(received[0].payload).events[0]
    assert isinstance(decoded, wire.BlockStored) and decoded.token_ids == (first.seq,) * 16

    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(WAIT_MS), "no end of replay"
            empty, *frames = dealer.recv_multipart()
            assert empty == b""
            message = wire.read_message(frames)
            if message.ends_replay:
                break
            replayed.append(message)
    finally:
        dealer.close(linger=0)
    # buffer_steps 3: the last three batches only, in order.
    assert [m.seq for m in replayed] == [sent - 1, sent, sent + 1]
    assert [m.payload for m in replayed] == [m.payload for m in received[-3:]]


def test_the_config_takes_vllms_fields_and_refuses_others() -> None:
    assert KVEventsConfig.from_cli('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert not KVEventsConfig.from_cli('{"enable_kv_cache_events": false}').publishes
    with pytest.raises(ValueError, match="endpiont"):
        KVEventsConfig.from_cli('{"endpiont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="kafka"):
        KVEventsConfig.from_cli('{"publisher": "kafka"}')
    with pytest.raises(ValueError):
        KVEventsConfig.from_cli("[]")


def test_data_parallel_ranks_publish_on_ports_above_rank_zeros() -> None:
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://*:0", 3) == "tcp://*:0"
    assert offset_endpoint_port("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint_port(None, 2) is None


def replay_from(port: int, start: int) -> list[wire.Message]:
    """Every buffered batch from ``start`` on, asked of the replay socket."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        messages: list[wire.Message] = []
        while True:
            assert dealer.poll(WAIT_MS), "no end of replay"
            _, *frames = dealer.recv_multipart()
            message = wire.read_message(frames)
            if message.ends_replay:
                return messages
            messages.append(message)
    finally:
        dealer.close(linger=0)


async def test_a_served_engine_announces_a_prompts_blocks_as_vllm_does(
    engine_factory: EngineFactory,
) -> None:
    port, replay = free_port(), free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay}",
    )
    prompt = "abcd" * 40  # 40 stand-in tokens of 4 bytes: two full blocks of 16
    async with engine_factory(kv_events=config, prefix_caching_hash_algo="sha256_cbor") as sim:
        async with httpx.AsyncClient(base_url=sim.url) as client:
            answer = await client.post(
                "/v1/completions",
                json={"model": TEST_MODEL, "prompt": prompt, "max_tokens": 1},
            )
        assert answer.status_code == 200, answer.text
        messages = await asyncio.to_thread(replay_from, replay, 0)
    events = [e for m in messages for e in wire.decode_batch(m.payload).events]
    stored = [e for e in events if isinstance(e, wire.BlockStored)]
    assert [m.seq for m in messages] == list(range(len(messages)))
    assert len(stored) == 1 and stored[0].parent_block_hash is None
    block = stored[0]
    token = int.from_bytes(b"abcd", "little")
    assert block.block_size == 16 and block.token_ids == (token,) * 32
    # vLLM's default: the hashes' low 64 bits as integers, sha256_cbor as asked.
    hasher = BlockHasher("sha256_cbor")
    first = hasher.block(None, [token] * 16)
    second = hasher.block(first, [token] * 16)
    assert block.block_hashes == tuple(int.from_bytes(h[-8:], "big") for h in (first, second))
    assert {b.rank for m in messages for b in [wire.decode_batch(m.payload)]} == {0}


def stand_in_ids(text: str) -> list[int]:
    return token_ids(encode_piece(text))


async def complete(client: httpx.AsyncClient, prompt: str) -> dict[str, Any]:
    answer = await client.post(
        "/v1/completions", json={"model": TEST_MODEL, "prompt": prompt, "max_tokens": 1}
    )
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def stored_ids(messages: list[wire.Message]) -> list[int]:
    return [
        t
        for m in messages
        for e in wire.decode_batch(m.payload).events
        if isinstance(e, wire.BlockStored)
        for t in e.token_ids
    ]


async def receive_while_completing(
    sub: zmq.Socket[bytes], client: httpx.AsyncClient, key: str
) -> tuple[wire.Message, int]:
    """Complete prompts ``key0``, ``key1``, ... until ``sub`` receives a batch (ZMQ's slow
    joiner: a publisher takes in a subscription only when it next sends); returns the
    batch and how many were completed."""
    sent = 0
    while not await asyncio.to_thread(sub.poll, 100):
        await complete(client, text_for(f"{key}{sent}", 40))
        sent += 1
        assert sent < 50, "the subscriber never received a batch"
    return wire.read_message(sub.recv_multipart()), sent


async def test_a_restarted_engine_publishes_from_sequence_zero_with_nothing_to_replay(
    engine_factory: EngineFactory,
) -> None:
    port, replay = free_port(), free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}"
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        async with engine_factory(kv_events=config) as sim:
            sub.connect(f"tcp://127.0.0.1:{port}")
            async with httpx.AsyncClient(base_url=sim.url) as client:
                _, sent = await receive_while_completing(sub, client, "before")
                for i in range(3):
                    await complete(client, text_for(f"more{i}", 40))
                before = await asyncio.to_thread(replay_from, replay, 0)
                answer = await client.post("/sim/restart")
                assert answer.status_code == 200
                while await asyncio.to_thread(sub.poll, 100):
                    wire.read_message(sub.recv_multipart())  # what was sent before
                # The subscriber reconnects to the new publisher on its own.
                first, after_sent = await receive_while_completing(sub, client, "after")
                after = await asyncio.to_thread(replay_from, replay, 0)
    finally:
        sub.close(linger=0)
    assert [m.seq for m in before] == list(range(sent + 3))
    # A new process: numbered from 0 again, and only its own batches to replay (the
    # first being the first prompt's blocks, no AllBlocksCleared).
    assert [m.seq for m in after] == list(range(after_sent))
    assert first.seq < after_sent and first.payload == after[first.seq].payload
    events = wire.decode_batch(after[0].payload).events
    assert all(isinstance(e, wire.BlockStored) for e in events)
    assert stored_ids(after[:1]) == stand_in_ids(text_for("after0", 40))[:32]


async def test_reset_prefix_cache_clears_the_cache_and_says_so_on_the_same_stream(
    engine_factory: EngineFactory,
) -> None:
    port, replay = free_port(), free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}"
    )
    prompt = text_for("reset", 40)
    async with engine_factory(kv_events=config) as sim:
        async with httpx.AsyncClient(base_url=sim.url) as client:
            await complete(client, prompt)
            warm = await complete(client, prompt)
            # A request holding blocks keeps the cache as it is (vLLM refuses).
            long = {
                "model": TEST_MODEL,
                "prompt": "x",
                "max_tokens": 20_000,
                "ignore_eos": True,
                "stream": True,
            }
            async with client.stream("POST", "/v1/completions", json=long) as held:
                assert held.status_code == 200
                async for _ in held.aiter_lines():
                    break  # its first token: it runs, holding its blocks
                assert sim.engine.scheduler.running
                refused = await client.post("/reset_prefix_cache")
                still = await complete(client, prompt)
                forced = await client.post("/reset_prefix_cache?reset_running_requests=true")
                cold = await complete(client, prompt)
        messages = await asyncio.to_thread(replay_from, replay, 0)
    hit = (40 - 1) // 16 * 16
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
    assert refused.status_code == 200 and refused.content == b""
    assert still["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
    assert forced.status_code == 200
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # One stream throughout; the clear goes out with the next step's events, first.
    assert [m.seq for m in messages] == list(range(len(messages)))
    cleared = [
        (i, j)
        for i, m in enumerate(messages)
        for j, e in enumerate(wire.decode_batch(m.payload).events)
        if isinstance(e, wire.AllBlocksCleared)
    ]
    assert len(cleared) == 1 and cleared[0][1] == 0
