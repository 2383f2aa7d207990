"""A hybrid model's sliding-window groups in the simulated engine: the hits it reports
equal a real vLLM 0.32 engine's on the same prompts (recorded), its events are read by
the router into predictions equal to the hits it then reports, and it announces its
groups as vLLM does."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import msgspec

from bench.sim.kv_cache import BlockPool
from bench.sim.kv_event_log import EngineEvents
from bench.sim.request import SimRequest
from bench.sim.scheduler import Scheduler
from bench.sim.vllm_hash import BlockHasher
from bench.sim.windows import WindowGroups
from router.index.events import decode_batch
from router.index.exact import ExactResidency
from router.index.prefix import chain_seed, prefix_key
from router.wire.blocks import token_bytes
from tests.sim.test_sim_kv_event_log import Payloads

RECORDED = Path(__file__).parents[1] / "data/vllm/hybrid-gemma3-w64-events.json"
BLOCK = 32  # as the recorded engine's
WINDOW = 64
GROUPS = 2  # sliding, sliding, full x 2: two window groups and one full
USABLE_BLOCKS = 63  # --num-gpu-blocks-override 64, one of them vLLM's null block
ROUTER_BLOCK = 16


class HybridEngine:
    def __init__(self) -> None:
        self.pool = BlockPool(USABLE_BLOCKS, BLOCK)
        windows = WindowGroups(WINDOW, GROUPS, BLOCK)
        self.scheduler = Scheduler(self.pool, 4, 2048, windows=windows)
        self.sink = Payloads()
        log = EngineEvents(self.sink, BlockHasher("sha256", "0"), BLOCK, windows=(WINDOW, GROUPS))
        self.scheduler.publish_kv_events(log)
        self.now = 0.0
        self.count = 0

    def serve(self, prompt: list[int], max_output: int = 1) -> SimRequest:
        self.count += 1
        request = SimRequest(
            f"r{self.count}", token_bytes(prompt), max_output, 0.0, BLOCK, random.Random(1)
        )
        self.scheduler.add(request)
        while self.scheduler.has_work:
            plan = self.scheduler.schedule(self.now)
            self.now += 0.01
            self.scheduler.complete(plan, self.now)
        return request


def recorded() -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = json.loads(RECORDED.read_text())["steps"]
    return steps


def test_its_hits_equal_a_real_engines_on_the_same_prompts() -> None:
    """Repeats, an extension, two prompts that share blocks but not the window before
    they part (the second one's hit comes from the junction the first left), a long
    decode and fillers that evict: every cached_tokens as the real engine reported."""
    engine = HybridEngine()
    got = []
    for step in recorded():
        output = 150 if "decode" in step["step"] else 1
        served = engine.serve(step["prompt"], output)
        got.append((step["step"], served.cached_tokens, step["cached_tokens"]))
    assert [(name, ours) for name, ours, _ in got] == [(name, real) for name, _, real in got]
    assert {real for _, _, real in got} >= {0, 128, 192, 320}


def test_the_router_reads_its_groups_into_the_hits_it_reports() -> None:
    """A conversation's turns (each its prompt, the reply, a new message): a window
    group keeps no reply's blocks, so each turn hits only as far as the previous
    prompt's end, which the router predicts from the engine's events alone."""
    engine = HybridEngine()
    residency = ExactResidency(10_000, "m", ttl_s=0.0, block_tokens=ROUTER_BLOCK)
    rng = random.Random(3)
    history = [rng.randrange(1000, 100_000) for _ in range(150)]
    seen, pairs = 0, []
    for _ in range(5):
        keys = prefix_key(token_bytes(history), 4 * ROUTER_BLOCK, chain_seed("m", None)).hashes
        held = residency.longest_prefix(keys, {}) * ROUTER_BLOCK
        predicted = min(held, len(history) - 1) // BLOCK * BLOCK
        served = engine.serve(history, max_output=40)
        pairs.append((predicted, served.cached_tokens))
        for payload in engine.sink.sent[seen:]:
            residency.apply(0, decode_batch(payload).events)
        seen = len(engine.sink.sent)
        reply = bytes(served.output)
        history += [int.from_bytes(reply[i : i + 4], "little") for i in range(0, len(reply), 4)]
        history += [rng.randrange(1000, 100_000) for _ in range(70)]
    assert [p for p, _ in pairs] == [c for _, c in pairs]
    # Each later turn hit the previous prompt's last whole block short of its last
    # token, not the reply after it (150, 260, 370, 480 tokens: 4, 8, 11, 14 blocks).
    assert [c for _, c in pairs] == [0, 128, 256, 352, 448]


def test_its_groups_are_announced_as_vllms_window_groups_first() -> None:
    engine = HybridEngine()
    engine.serve(recorded()[0]["prompt"])  # 200 tokens: six whole blocks
    (payload,) = engine.sink.sent
    events = msgspec.msgpack.decode(payload)[1]
    shape = [
        (e["group_idx"], e["kv_cache_spec_kind"], e.get("kv_cache_spec_sliding_window"))
        for e in events
    ]
    assert shape == [
        (0, "sliding_window", WINDOW),
        (1, "sliding_window", WINDOW),
        (2, "full_attention", None),
    ]
    window, _, full = events
    # The window groups keep the last two blocks short of the prompt's last token,
    # named as the full-attention group names them; their tokens span all six blocks.
    assert window["block_hashes"] == full["block_hashes"][4:6]
    assert len(window["token_ids"]) == len(full["token_ids"]) == 6 * BLOCK
