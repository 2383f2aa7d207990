"""The simulated engine's CPU offload tier held to vLLM's offloading connector.

One real engine (vLLM 0.32's CPU build, tiny Qwen3) runs the ``OffloadingConnector``
with self-describing KV events. Its own CPU spec refuses the CPU platform, so the
engine loads ``bench/real/offload_spec/host_offload_spec.py`` through the connector's
out-of-tree spec hook: vLLM's manager, LRU, events and metrics, with a synchronous copy
in place of its CUDA worker. A simulator is configured to match (block size, usable GPU
blocks, a tier of as many blocks, self-describing events, the tokenizer), and both run
the same prompts of token ids, one at a time:

    A             cold: stored on the GPU, then written through to the CPU tier
    fill 1..6     other prompts until A has left the GPU (the tier still has room)
    A again       loaded back from the CPU tier
    fill 7..11    until the tier evicts, least recently used first

Hashes differ between the engines, so what is compared is what they mean: which prompt's
block an event names, in which batch, next to which other events. Three facts the
simulator got wrong when this test was first run are held here too, each test saying
what it did (``docs/engines/sim-vs-vllm.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from bench.real.vllm_cpu import REPO
from bench.sim.config import EngineConfig
from bench.sim.kv_events import KVEventsConfig
from router.planning.capacity import gpu, load_model
from tests.conftest import serve_engine
from tests.vllm_engines import (
    BLOCK_TOKENS,
    MODEL_NAME,
    VllmEngine,
    free_ports,
    install_vllm,
    start_engines,
    write_model,
)

pytestmark = pytest.mark.timeout(300)

NUM_BLOCKS = 24  # --num-gpu-blocks-override; vLLM keeps one as its null block
GPU_BLOCKS = NUM_BLOCKS - 1  # those holding tokens
MAX_MODEL_LEN = 512  # vLLM refuses a context longer than its cache
TIER_BLOCKS = 40  # more than the GPU's: what A's eviction pushes out stays in the tier
# A block of the tiny Qwen3: 2 layers x (K, V) x 2 KV heads x 32 dims x 2 bytes x 32 tokens.
BLOCK_BYTES = 16_384
PROMPT_BLOCKS = 4
PROMPT_TOKENS = PROMPT_BLOCKS * BLOCK_TOKENS + 8  # and a partial block, never cached
A_TOKENS = PROMPT_BLOCKS * BLOCK_TOKENS
GPU_FILLERS = 6  # 5 blocks a prompt in 23: A's four are gone by the 6th
TIER_FILLERS = 5  # 28 blocks in the tier after A again: the 10th and 11th fillers overflow it
SPEC_DIR = REPO / "bench" / "real" / "offload_spec"
QUIET_MS = 300  # an engine's events for a request are out once it has been this quiet
GPU, CPU = "GPU", "CPU"
ENGINES = ("real", "sim")


def transfer_config() -> dict[str, Any]:
    """vLLM's offloading connector with ``host_offload_spec`` (on PYTHONPATH)."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": TIER_BLOCKS * BLOCK_BYTES,
            "spec_name": "HostCPUOffloadingSpec",
            "spec_module_path": "host_offload_spec",
            "self_describing_kv_events": True,
        },
    }


def prompt(seed: int) -> list[int]:
    """Token ids of ordinary vocabulary, distinct for each seed."""
    rng = random.Random(seed)
    return [rng.randrange(1_000, 150_000) for _ in range(PROMPT_TOKENS)]


# -- what an engine was seen to do ---------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    events: list[dict[str, Any]]


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """One request: its prompt, its usage's cached tokens, and the event batches the
    engine published from when it was sent until the engine fell quiet."""

    prompt: list[int]
    cached_tokens: int
    batches: list[Batch]

    def events(self, kind: str, medium: str) -> list[tuple[int, dict[str, Any]]]:
        """(batch seq, event) of each ``kind`` event of ``medium``, in order."""
        return [
            (batch.seq, event)
            for batch in self.batches
            for event in batch.events
            if event["type"] == kind and event.get("medium") == medium
        ]

    def hashes(self, kind: str, medium: str) -> list[Any]:
        return [h for _, event in self.events(kind, medium) for h in event["block_hashes"]]

    def batch(self, seq: int) -> Batch:
        (found,) = [batch for batch in self.batches if batch.seq == seq]
        return found


@dataclasses.dataclass(frozen=True, slots=True)
class Trace:
    steps: dict[str, Step]
    metrics_before: dict[str, float]
    metrics_after: dict[str, float]

    def fillers(self, first: int, last: int) -> list[Step]:
        return [self.steps[f"fill {i}"] for i in range(first, last + 1)]

    def a_hashes(self) -> list[Any]:
        """A's blocks as the engine named them when it cached them on the GPU."""
        return self.steps["A"].hashes("BlockStored", GPU)

    def grown(self, name: str) -> float:
        return self.metrics_after[name] - self.metrics_before[name]


class EventTap:
    """A SUB on an engine's KV event stream, read request by request."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str) -> None:
        self._socket = context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)

    async def until_quiet(self) -> list[Batch]:
        """The batches received until none came for ``QUIET_MS``."""
        batches = []
        while await self._socket.poll(QUIET_MS):
            *_, seq, payload = await self._socket.recv_multipart()
            _, events, *_ = msgspec.msgpack.decode(payload)
            batches.append(Batch(int.from_bytes(seq, "big", signed=True), events))
        return batches

    def close(self) -> None:
        self._socket.close(linger=0)


@contextlib.asynccontextmanager
async def tapped(endpoint: str) -> AsyncIterator[EventTap]:
    context = zmq.asyncio.Context()
    tap = EventTap(context, endpoint)
    try:
        await tap.until_quiet()  # a SUB misses what is sent before it has joined
        yield tap
    finally:
        tap.close()
        context.term()


async def cached_tokens(http: aiohttp.ClientSession, url: str, ids: list[int]) -> int:
    body = {
        "model": MODEL_NAME,
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    async with http.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        usage = (await response.json())["usage"]
    assert usage["prompt_tokens"] == PROMPT_TOKENS
    return int(usage["prompt_tokens_details"]["cached_tokens"])


# The counters a load from the tier raises: each a sample name and the labels it carries.
OFFLOAD_COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "offload hits": ("vllm:external_prefix_cache_hits_total", {}),
    "cached on host": ("vllm:prompt_tokens_cached_by_source_total", {"source": "host"}),
}


async def offload_metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Each of ``OFFLOAD_COUNTERS``, summed over its other labels."""
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    found = dict.fromkeys(OFFLOAD_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key, (name, labels) in OFFLOAD_COUNTERS.items():
                if sample.name == name and labels.items() <= sample.labels.items():
                    found[key] += sample.value
    return found


def workload() -> list[tuple[str, list[int]]]:
    a = prompt(0)
    fills = [(f"fill {i}", prompt(i)) for i in range(1, GPU_FILLERS + TIER_FILLERS + 1)]
    return [("A", a), *fills[:GPU_FILLERS], ("A again", a), *fills[GPU_FILLERS:]]


async def observe(url: str, events_endpoint: str) -> Trace:
    steps = {}
    async with aiohttp.ClientSession() as http, tapped(events_endpoint) as tap:
        before = await offload_metrics(http, url)
        for name, ids in workload():
            cached = await cached_tokens(http, url, ids)
            steps[name] = Step(ids, cached, await tap.until_quiet())
        after = await offload_metrics(http, url)
    return Trace(steps, before, after)


async def observe_sim(real: VllmEngine) -> Trace:
    """The workload on a simulator configured as ``real`` is."""
    events, replay = free_ports(2)
    config = EngineConfig(
        model=load_model(str(real.model_dir / "config.json")),
        gpu=gpu("h100"),
        served_model_name=MODEL_NAME,
        kv_tokens=GPU_BLOCKS * BLOCK_TOKENS,
        block_tokens=BLOCK_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        tokenizer=str(real.model_dir),
        kv_events=KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"tcp://*:{events}",
            replay_endpoint=f"tcp://127.0.0.1:{replay}",
        ),
        kv_offloading_bytes=TIER_BLOCKS * BLOCK_BYTES,
        kv_offloading_self_describing_events=True,
    )
    async with serve_engine(config) as sim:
        tier = sim.engine.scheduler.offload
        assert tier is not None and tier.capacity_blocks == TIER_BLOCKS
        assert sim.engine.num_blocks == GPU_BLOCKS
        return await observe(sim.url, f"tcp://127.0.0.1:{events}")


@pytest.fixture(scope="module")
def offloading_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    """A real engine with the offloading connector, for this module only (~3 GB)."""
    engine = VllmEngine(
        install_vllm(),
        write_model(tmp_path_factory.mktemp("tiny-qwen3")),
        tmp_path_factory.mktemp("vllm-offload-logs"),
        "offload",
        extra_flags=("--kv-transfer-config", json.dumps(transfer_config())),
        num_blocks=NUM_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        extra_env={"PYTHONPATH": str(SPEC_DIR)},
    )
    asyncio.run(start_engines([engine]))
    try:
        log = engine.log_path.read_text(errors="replace")
        assert f"offload tier of {TIER_BLOCKS} chunks of {BLOCK_BYTES} bytes" in log
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def traces(offloading_vllm: VllmEngine) -> dict[str, Trace]:
    real = asyncio.run(observe(offloading_vllm.url, offloading_vllm.kv_events_endpoint))
    return {"real": real, "sim": asyncio.run(observe_sim(offloading_vllm))}


# -- the facts, each on both engines ---------------------------------------------------------

# Fields whose values do not depend on the prompt: equal on both engines.
FIXED_FIELDS = ("type", "medium", "block_size", "lora_id", "lora_name", "group_idx")


def event_forms(trace: Trace) -> set[tuple[Any, ...]]:
    """Each distinct event as its field names and its prompt-independent values."""
    return {
        (tuple(sorted(event)), tuple(event.get(name) for name in FIXED_FIELDS))
        for step in trace.steps.values()
        for batch in step.batches
        for event in batch.events
    }


def test_both_engines_announce_events_of_the_same_forms(traces: dict[str, Trace]) -> None:
    assert event_forms(traces["sim"]) == event_forms(traces["real"])


@pytest.mark.parametrize("engine", ENGINES)
def test_no_batch_was_missed_and_only_the_load_hit(traces: dict[str, Trace], engine: str) -> None:
    trace = traces[engine]
    seqs = [batch.seq for step in trace.steps.values() for batch in step.batches]
    assert seqs == list(range(len(seqs)))
    cached = {name: step.cached_tokens for name, step in trace.steps.items()}
    assert cached == {name: A_TOKENS if name == "A again" else 0 for name, _ in workload()}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_cold_prompt_reaches_the_cpu_a_batch_after_the_gpu_one_event_a_block(
    traces: dict[str, Trace], engine: str
) -> None:
    step = traces[engine].steps["A"]
    ((gpu_seq, stored),) = step.events("BlockStored", GPU)
    a = stored["block_hashes"]
    assert len(a) == PROMPT_BLOCKS and stored["parent_block_hash"] is None
    assert stored["token_ids"] == step.prompt[:A_TOKENS]
    cpu = step.events("BlockStored", CPU)
    assert [len(event["block_hashes"]) for _, event in cpu] == [1] * PROMPT_BLOCKS
    assert all(seq > gpu_seq for seq, _ in cpu)
    # vLLM announces a batch's chunks in no particular order: each is matched by its hash.
    by_hash = {event["block_hashes"][0]: event for _, event in cpu}
    assert sorted(by_hash) == sorted(a)
    for i, h in enumerate(a):
        event = by_hash[h]
        assert event["parent_block_hash"] == (a[i - 1] if i else None)
        assert event["token_ids"] == step.prompt[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
        assert event["block_size"] == BLOCK_TOKENS


@pytest.mark.parametrize("engine", ENGINES)
def test_filling_the_gpu_evicts_a_there_and_not_from_the_tier(
    traces: dict[str, Trace], engine: str
) -> None:
    trace = traces[engine]
    fillers = trace.fillers(1, GPU_FILLERS)
    removed = [h for step in fillers for h in step.hashes("BlockRemoved", GPU)]
    assert set(trace.a_hashes()) <= set(removed)
    assert all(step.events("BlockRemoved", CPU) == [] for step in fillers)
    stored = [len(step.events("BlockStored", CPU)) for step in fillers]
    assert stored == [PROMPT_BLOCKS] * GPU_FILLERS


@pytest.mark.parametrize("engine", ENGINES)
def test_a_leaves_the_gpu_tail_first_after_the_fillers_partial_blocks(
    traces: dict[str, Trace], engine: str
) -> None:
    """vLLM puts a freed block that holds no hash (a prompt's partial last block) at the
    head of the free queue, to be reused first (``v1/core/block_pool.py:774-803``); the
    simulator's ``BlockPool.release`` queued it at the tail with the cached ones, so it
    evicted cached blocks a block sooner (A's last block at fill 4, the rest at 5)."""
    trace = traces[engine]
    a = trace.a_hashes()
    filler_that_evicted = {
        a.index(h): filler
        for filler, step in enumerate(trace.fillers(1, GPU_FILLERS), start=1)
        for h in step.hashes("BlockRemoved", GPU)
        if h in a
    }
    assert filler_that_evicted == {3: 5, 2: 5, 1: 6, 0: 6}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_again_is_loaded_from_the_cpu_silently_and_announced_by_the_gpu(
    traces: dict[str, Trace], engine: str
) -> None:
    trace = traces[engine]
    step = trace.steps["A again"]
    assert step.cached_tokens == A_TOKENS
    assert step.events("BlockStored", CPU) == step.events("BlockRemoved", CPU) == []
    ((_, stored),) = step.events("BlockStored", GPU)
    assert stored["block_hashes"] == trace.a_hashes()
    assert stored["parent_block_hash"] is None
    assert stored["token_ids"] == step.prompt[:A_TOKENS]
    # Never written to the tier again: the tier already holds what it loaded.
    later = [s for name, s in trace.steps.items() if name != "A"]
    assert not {h for s in later for h in s.hashes("BlockStored", CPU)} & set(trace.a_hashes())


@pytest.mark.parametrize("engine", ENGINES)
def test_a_load_takes_an_engine_step_of_its_own(traces: dict[str, Trace], engine: str) -> None:
    """vLLM allocates the blocks a load fills in one step (evicting for them, and
    publishing that step's events even though it runs no tokens:
    ``v1/core/sched/scheduler.py:1320-1323`` and ``2371-2385``) and caches them when
    the copy has finished, in a later step. The simulator published nothing for a step
    without work, so the evictions came in the batch that announced the loaded blocks."""
    step = traces[engine].steps["A again"]
    ((stored_seq, _),) = step.events("BlockStored", GPU)
    evicted_seqs = [seq for seq, _ in step.events("BlockRemoved", GPU)]
    assert evicted_seqs and min(evicted_seqs) < stored_seq


@pytest.mark.parametrize("engine", ENGINES)
def test_a_full_tier_evicts_its_least_recently_used_one_event_a_batch(
    traces: dict[str, Trace], engine: str
) -> None:
    trace = traces[engine]
    evicting = {n: s for n, s in trace.steps.items() if s.events("BlockRemoved", CPU)}
    assert list(evicting) == ["fill 10", "fill 11"]
    # The oldest stores are fill 1's, then fill 2's; A's are older still but its load
    # made them the tier's most recently used.
    for step, oldest in zip(evicting.values(), trace.fillers(1, 2), strict=True):
        ((seq, removed),) = step.events("BlockRemoved", CPU)
        assert sorted(removed["block_hashes"]) == sorted(oldest.hashes("BlockStored", GPU))
        # Room made for the step's own blocks: in the batch of their GPU store, after it
        # (the pool's events, then the connector's), before their CPU stores.
        ((gpu_seq, gpu_stored),) = step.events("BlockStored", GPU)
        assert gpu_seq == seq
        events = step.batch(seq).events
        assert events.index(gpu_stored) < events.index(removed)
        assert all(cpu_seq > seq for cpu_seq, _ in step.events("BlockStored", CPU))


@pytest.mark.parametrize("engine", ENGINES)
def test_the_tier_evicts_a_prompts_blocks_tail_first(traces: dict[str, Trace], engine: str) -> None:
    """vLLM's LRU policy ranks a finished request's chunks in reverse
    (``v1/kv_offload/cpu/policies/lru.py:104``, and ``:93`` for a lookup's touch), so a
    prompt's last chunk is its least recently used: a tier that overflows part-way
    through a prompt keeps the prompt's head, still a usable prefix. The simulator's
    ``OffloadTier`` ordered a prompt's blocks head first, so it dropped the head and kept
    a tail no lookup can reach. The eviction's event lists the blocks in the order they
    went."""
    trace = traces[engine]
    removed = trace.steps["fill 10"].hashes("BlockRemoved", CPU)
    assert removed == trace.steps["fill 1"].hashes("BlockStored", GPU)[::-1]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_load_counts_as_host_hits_in_the_metrics(traces: dict[str, Trace], engine: str) -> None:
    trace = traces[engine]
    assert trace.grown("cached on host") == A_TOKENS
    assert trace.grown("offload hits") == A_TOKENS
