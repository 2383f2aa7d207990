"""The simulated engine's CPU offload tier, as vLLM's native offloading connector keeps
it: every cached block written through to CPU memory, a GPU eviction leaving the CPU
copy, a prompt continuing its GPU hit there loaded back before it runs (its usage
counting the loaded tokens as cached), the tier's own LRU, and the events of both tiers."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from bench.sim.cli import self_describing_offload_events
from bench.sim.config import EngineConfig
from bench.sim.engine import Engine, offload_tier
from bench.sim.kv_cache import BlockPool
from bench.sim.kv_event_log import EngineEvents
from bench.sim.offload import OffloadTier
from bench.sim.request import SimRequest
from bench.sim.scheduler import Scheduler
from bench.sim.vllm_hash import BlockHasher
from router.planning.capacity import gpu, load_model
from tests.sim.test_sim_kv_event_log import Payloads, tokens

BLOCK = 4
LOAD_S_PER_BLOCK = 0.5
STEP_S = 0.01
MAX_STEPS = 10_000


def request(name: str, prompt: bytes, max_output: int = 1) -> SimRequest:
    return SimRequest(name, prompt, max_output, 0.0, BLOCK, random.Random(name))


class Fleet:
    """One scheduler with a small GPU pool, an offload tier and its events."""

    def __init__(self, gpu_blocks: int, cpu_blocks: int, self_describing: bool = True) -> None:
        self.pool = BlockPool(gpu_blocks, BLOCK)
        self.tier = OffloadTier(cpu_blocks)
        self.scheduler = Scheduler(self.pool, 4, 64, self.tier, LOAD_S_PER_BLOCK)
        self.sink = Payloads()
        hasher = BlockHasher("sha256", "0")
        self.log = EngineEvents(self.sink, hasher, BLOCK, self_describing=self_describing)
        self.scheduler.publish_kv_events(self.log)
        self.now = 0.0
        self.started: dict[str, float] = {}
        self.offload_hits = 0  # tokens the tier's lookups found, as the metrics count them

    def run(self, *requests: SimRequest) -> None:
        """Until every request finished, a step every STEP_S; when each first ran."""
        for r in requests:
            self.scheduler.add(r)
        for _ in range(MAX_STEPS):
            if not self.scheduler.has_work:
                break
            plan = self.scheduler.schedule(self.now)
            self.offload_hits += sum(hit for _, hit in plan.offload_queries)
            for r, _, _ in plan.work:
                self.started.setdefault(r.id, self.now)
            self.now += STEP_S
            self.scheduler.complete(plan, self.now)
        assert not self.scheduler.has_work, "the engine stalled"
        self.log.idle()

    def events(self) -> list[dict[str, Any]]:
        """Every event sent, as maps, in order."""
        return [event for batch in self.batches() for event in batch]

    def batches(self) -> list[list[dict[str, Any]]]:
        return [msgspec.msgpack.decode(payload)[1] for payload in self.sink.sent]


def hashes_on(events: list[dict[str, Any]], kind: str, medium: str) -> list[Any]:
    return [
        h
        for e in events
        if e["type"] == kind and e.get("medium") == medium
        for h in e["block_hashes"]
    ]


def test_an_evicted_prefix_is_loaded_back_from_cpu_and_counts_as_cached() -> None:
    rng = random.Random(1)
    fleet = Fleet(gpu_blocks=12, cpu_blocks=100)
    first = request("a1", tokens(rng, 8 * BLOCK))
    fleet.run(first)
    stored_gpu = hashes_on(fleet.events(), "BlockStored", "GPU")
    assert len(stored_gpu) == 8
    assert hashes_on(fleet.events(), "BlockStored", "CPU") == stored_gpu
    fleet.run(request("b", tokens(rng, 12 * BLOCK - 1)))  # pushes a1's blocks off the GPU
    removed_gpu = hashes_on(fleet.events(), "BlockRemoved", "GPU")
    assert set(stored_gpu) <= set(removed_gpu)
    assert hashes_on(fleet.events(), "BlockRemoved", "CPU") == []

    sent = len(fleet.sink.sent)
    loaded_at = fleet.now
    again = request("a2", first.prompt + tokens(rng, 2 * BLOCK + 1))
    fleet.run(again)
    assert again.cached_tokens == 8 * BLOCK
    # It waited for its 8 blocks to cross the host link before its first step.
    assert fleet.started["a2"] >= loaded_at + 8 * LOAD_S_PER_BLOCK
    assert fleet.started["a2"] < loaded_at + 8 * LOAD_S_PER_BLOCK + 2 * STEP_S
    later = [e for p in fleet.sink.sent[sent:] for e in msgspec.msgpack.decode(p)[1]]
    # Loaded back, the blocks are the GPU's again (announced); the CPU keeps its copies.
    assert hashes_on(later, "BlockStored", "GPU")[:8] == stored_gpu
    assert not set(hashes_on(later, "BlockStored", "CPU")) & set(stored_gpu)


def test_the_tiers_events_come_as_vllms_do() -> None:
    """A step's batch: the pool's events, then the tier's evictions for the blocks it
    stores (one event), then the stores the step before started (one event a block,
    complete now; the last ones when the engine falls idle)."""
    rng = random.Random(7)
    fleet = Fleet(gpu_blocks=40, cpu_blocks=5)
    fleet.run(request("a", tokens(rng, 3 * BLOCK)))
    first = fleet.batches()
    assert [[(e["type"], e["medium"]) for e in batch] for batch in first] == [
        [("BlockStored", "GPU")],
        [("BlockStored", "CPU")] * 3,
    ]
    assert [e["block_hashes"] for e in first[1]] == [[h] for h in first[0][0]["block_hashes"]]
    assert [e["parent_block_hash"] for e in first[1]] == [None, *first[0][0]["block_hashes"][:2]]
    fleet.run(request("b", tokens(rng, 3 * BLOCK)))  # 6 blocks for a 5-block tier
    stored, completed = fleet.batches()[2:]
    assert [(e["type"], e["medium"]) for e in stored] == [
        ("BlockStored", "GPU"),
        ("BlockRemoved", "CPU"),
    ]
    # a's end ranked its blocks last first: its last block is the least recently used.
    assert stored[1]["block_hashes"] == first[0][0]["block_hashes"][2:]
    assert [e["type"] for e in completed] == ["BlockStored"] * 3


def test_a_prefix_still_on_the_gpu_is_not_loaded() -> None:
    rng = random.Random(2)
    fleet = Fleet(gpu_blocks=40, cpu_blocks=100)
    first = request("a1", tokens(rng, 6 * BLOCK))
    fleet.run(first)
    start = fleet.now
    again = request("a2", first.prompt + tokens(rng, BLOCK + 1))
    fleet.run(again)
    assert again.cached_tokens == 6 * BLOCK
    assert fleet.started["a2"] == start


def test_the_load_goes_on_from_where_the_gpu_hit_ends() -> None:
    rng = random.Random(3)
    fleet = Fleet(gpu_blocks=12, cpu_blocks=100)
    shared = tokens(rng, 3 * BLOCK)
    first = request("a1", shared + tokens(rng, 5 * BLOCK))
    fleet.run(first)
    fleet.run(request("b", tokens(rng, 12 * BLOCK - 1)))  # evicts a1's blocks
    fleet.run(request("c", shared + tokens(rng, BLOCK + 1)))  # the shared head back on GPU
    start = fleet.now
    again = request("a2", first.prompt + tokens(rng, BLOCK + 1))
    fleet.run(again)
    assert again.cached_tokens == 8 * BLOCK
    # Only the 5 blocks beyond the GPU's 3 crossed the link.
    assert start + 5 * LOAD_S_PER_BLOCK <= fleet.started["a2"] < start + 6 * LOAD_S_PER_BLOCK


def test_the_tier_evicts_its_least_recently_used_tail_first_and_says_so() -> None:
    """A request's end ranks its blocks last first (vLLM's LRU policy): a tier that
    overflows part-way through a prompt keeps its head, still a prefix."""
    rng = random.Random(4)
    fleet = Fleet(gpu_blocks=12, cpu_blocks=12)
    first = request("a1", tokens(rng, 6 * BLOCK))
    fleet.run(first)
    fleet.run(request("b", tokens(rng, 9 * BLOCK)))  # 15 blocks written: 3 of a1's go
    events = fleet.events()
    a1 = hashes_on(events, "BlockStored", "CPU")[:6]
    assert hashes_on(events, "BlockRemoved", "CPU") == a1[:2:-1]
    assert len(fleet.tier) == 12
    # b took the GPU blocks of a1's tail too: a1's head is left, on both.
    start = fleet.now
    again = request("a2", first.prompt + tokens(rng, BLOCK + 1))
    fleet.run(again)
    assert again.cached_tokens == 3 * BLOCK
    assert fleet.started["a2"] == start  # nothing to load


def test_a_prefix_gone_from_both_tiers_is_computed_again() -> None:
    rng = random.Random(4)
    fleet = Fleet(gpu_blocks=12, cpu_blocks=10)
    first = request("a1", tokens(rng, 6 * BLOCK))
    fleet.run(first)
    fleet.run(request("b", tokens(rng, 12 * BLOCK - 1)))
    a1 = hashes_on(fleet.events(), "BlockStored", "CPU")[:6]
    assert hashes_on(fleet.events(), "BlockRemoved", "CPU")[:6] == a1[::-1]
    start = fleet.now
    again = request("a2", first.prompt + tokens(rng, BLOCK + 1))
    fleet.run(again)
    assert again.cached_tokens == 0
    assert fleet.started["a2"] == start


def test_without_self_describing_events_the_cpu_tier_announces_placeholders() -> None:
    rng = random.Random(5)
    fleet = Fleet(gpu_blocks=12, cpu_blocks=100, self_describing=False)
    fleet.run(request("a1", tokens(rng, 3 * BLOCK)))
    events = fleet.events()
    gpu_hashes = hashes_on(events, "BlockStored", "GPU")
    cpu = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "CPU"]
    assert [e["block_hashes"] for e in cpu] == [[h] for h in gpu_hashes]
    assert all(e["token_ids"] == [] and e["block_size"] == 0 for e in cpu)
    assert all(e["parent_block_hash"] is None for e in cpu)


def test_an_aborted_load_gives_its_blocks_back() -> None:
    rng = random.Random(6)
    fleet = Fleet(gpu_blocks=12, cpu_blocks=100)
    first = request("a1", tokens(rng, 8 * BLOCK))
    fleet.run(first)
    fleet.run(request("b", tokens(rng, 12 * BLOCK - 1)))
    again = request("a2", first.prompt + tokens(rng, BLOCK + 1))
    fleet.scheduler.add(again)
    fleet.scheduler.schedule(fleet.now)
    assert again.loading_until is not None
    assert fleet.pool.num_free == 12 - 8
    fleet.scheduler.abort(again)
    assert fleet.pool.num_free == 12
    assert not fleet.scheduler.has_work


def test_the_tier_is_sized_in_the_gpus_blocks_from_the_model() -> None:
    model = load_model("llama-3.1-8b")  # 131,072 bytes a token
    config = EngineConfig(
        model, gpu("h100"), "m", block_tokens=16, kv_offloading_bytes=4 * (1 << 30)
    )
    tier = offload_tier(config)
    assert tier is not None
    assert tier.capacity_blocks == 4 * (1 << 30) // (16 * 131_072)
    engine = Engine(config)
    # 16 tokens x 131,072 bytes over 50 GB/s
    assert engine.scheduler.load_seconds_per_block == pytest.approx(16 * 131_072 / 50e9)
    assert offload_tier(EngineConfig(model, gpu("h100"), "m")) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, False),
        ('{"kv_connector_extra_config": {"self_describing_kv_events": true}}', True),
        ('{"kv_connector_extra_config": {"self_describing_kv_events": false}}', False),
        ('{"kv_connector_extra_config": {}}', False),
    ],
)
def test_the_transfer_config_says_whether_events_describe_themselves(
    text: str | None, expected: bool
) -> None:
    assert self_describing_offload_events(text) is expected


@pytest.mark.parametrize(
    "text",
    [
        "{",
        "[]",
        '{"kv_connector": "LMCacheConnectorV1"}',
        '{"kv_connector_extra_config": {"cpu_bytes_to_use": 1}}',
        '{"kv_connector_extra_config": {"self_describing_kv_events": "yes"}}',
    ],
)
def test_a_transfer_config_the_simulator_does_not_simulate_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"kv-transfer-config|self_describing"):
        self_describing_offload_events(text)


def test_loads_that_hold_every_block_give_them_back_rather_than_stall() -> None:
    """Two prompts loading back at once hold ten of the GPU's twelve blocks, and each
    needs four more to run: nothing can run. The loads give their blocks back (what was
    loaded stays cached) and the two run one after the other."""
    rng = random.Random(8)
    fleet = Fleet(gpu_blocks=12, cpu_blocks=100)
    a, b = request("a", tokens(rng, 5 * BLOCK)), request("b", tokens(rng, 5 * BLOCK))
    fleet.run(a)
    fleet.run(b)
    fleet.run(request("c", tokens(rng, 12 * BLOCK - 1)))  # a and b leave the GPU
    again = [request(f"{r.id}2", r.prompt + tokens(rng, 3 * BLOCK + 1)) for r in (a, b)]
    fleet.run(*again)
    assert all(r.finished and r.finish_reason == "length" for r in again)
    assert [r.cached_tokens for r in again] == [5 * BLOCK, 5 * BLOCK]
    assert fleet.offload_hits == 10 * BLOCK  # each load counted once
