"""The simulated engine's KV events say exactly what its block pool holds: a router that
reads only the events (decoded and chained by router/kv_events) finds, for every prompt,
the same cached prefix as the pool, through eviction, shared prefixes, salts and a reset."""

from __future__ import annotations

import random

import msgspec
import xxhash

from bench.sim.kv_cache import BlockPool
from bench.sim.kv_event_log import EngineEvents
from bench.sim.kv_events import KVEventBatch
from bench.sim.request import SimRequest
from bench.sim.scheduler import Scheduler
from bench.sim.vllm_hash import BlockHasher
from router.index.chains import EngineChains
from router.index.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from router.index.prefix import chain_seed, prefix_key
from router.wire.blocks import token_block_hashes

BLOCK = 4
MODEL = "m"


class Payloads:
    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.sent: list[bytes] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.sent.append(self.encoder.encode(batch))


class EventReader:
    """What a router holds for the worker, from the events alone."""

    def __init__(self) -> None:
        self.chains = EngineChains(MODEL, max_blocks=10_000)
        self.held: set[int] = set()
        self.read = 0

    def catch_up(self, payloads: list[bytes]) -> None:
        for payload in payloads[self.read :]:
            for event in decode_batch(payload).events:
                if isinstance(event, BlockStored):
                    added, dropped = self.chains.stored(event)
                    self.held.update(added)
                    self.held.difference_update(dropped)
                elif isinstance(event, BlockRemoved):
                    self.held.difference_update(self.chains.removed(event.block_hashes))
                elif isinstance(event, AllBlocksCleared):
                    self.chains.clear()
                    self.held.clear()
        self.read = len(payloads)

    def match(self, prompt: bytes, salt: str | None) -> int:
        held = 0
        for h in prefix_key(prompt, BLOCK * 4, chain_seed(MODEL, salt)).hashes:
            if h not in self.held:
                break
            held += 1
        return held


def tokens(rng: random.Random, n: int) -> bytes:
    return b"".join(rng.randrange(1, 50_000).to_bytes(4, "little") for _ in range(n))


def run(scheduler: Scheduler, requests: list[SimRequest]) -> None:
    for request in requests:
        scheduler.add(request)
    now = 0.0
    while scheduler.has_work:
        now += 0.01
        scheduler.complete(scheduler.schedule(), now)


def test_the_events_name_exactly_the_blocks_the_pool_holds() -> None:
    rng = random.Random(5)
    pool = BlockPool(num_blocks=60, block_tokens=BLOCK)
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    sink = Payloads()
    scheduler.publish_kv_events(EngineEvents(sink, BlockHasher("sha256", "0"), BLOCK))
    reader = EventReader()
    system = tokens(rng, 22)  # a shared system prompt
    salts = [None, None, None, None, "tenant-a", "tenant-b"]
    sessions = [(system + tokens(rng, 5), salt) for salt in salts]
    probes: list[tuple[bytes, str | None]] = []
    counter = 0
    checked = partial = 0
    for turn in range(8):
        if turn == 5:
            # vLLM's /reset_prefix_cache: AllBlocksCleared goes out with the next step.
            assert scheduler.reset_prefix_cache() == (True, [])
        batch = []
        for i, (history, salt) in enumerate(sessions):
            if rng.random() < 0.4:
                continue
            counter += 1
            parent = xxhash.xxh3_64_intdigest(salt.encode()) if salt else 0
            request = SimRequest(
                f"r{counter}",
                history,
                rng.randrange(1, 12),
                0.0,
                BLOCK,
                random.Random(counter),
                parent,
                "length",
                None,
                salt,
            )
            batch.append((i, request))
        run(scheduler, [r for _, r in batch])
        for i, request in batch:
            history, salt = sessions[i]
            reply = request.output
            sessions[i] = (history + bytes(reply) + tokens(rng, rng.randrange(3, 9)), salt)
            probes.append((request.prompt + bytes(reply), salt))
        reader.catch_up(sink.sent)
        for prompt, salt in probes:
            parent = xxhash.xxh3_64_intdigest(salt.encode()) if salt else 0
            pool_match = len(pool.cached_prefix(token_block_hashes(prompt, BLOCK, parent), 10_000))
            assert reader.match(prompt, salt) == pool_match
            checked += 1
            partial += 0 < pool_match < len(prompt) // (4 * BLOCK)
    removed = sum(isinstance(e, BlockRemoved) for p in sink.sent for e in decode_batch(p).events)
    salted = sum(reader.match(p, salt) > 0 for p, salt in probes if salt)
    # Eviction, prefixes held in part and salted prompts held were all seen.
    assert checked > 50 and partial > 10 and removed > 20 and salted > 0
