"""A hybrid model's KV events, as a real vLLM 0.32 engine sent them, read into the
router's residency: its predicted cached tokens for every prompt equal what the engine
then reported, sliding-window groups included (a prompt hits only as far as every group
allows), where counting the full-attention group alone would over-predict."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from router.index.events import BlockStored, decode_batch
from router.index.exact import ExactResidency
from router.index.prefix import chain_seed, prefix_key
from router.index.windows import MAX_GROUPS
from router.wire.blocks import token_bytes

RECORDED = Path(__file__).parents[1] / "data/vllm/hybrid-gemma3-w64-events.json"
ROUTER_BLOCK = 16  # tokens: the router's blocks, two to each of the engine's 32
MODEL = "m"


def steps() -> list[dict[str, Any]]:
    recorded: list[dict[str, Any]] = json.loads(RECORDED.read_text())["steps"]
    return recorded


def keyed(prompt: list[int]) -> list[int]:
    return list(prefix_key(token_bytes(prompt), 4 * ROUTER_BLOCK, chain_seed(MODEL, None)).hashes)


def predicted(residency: ExactResidency, prompt: list[int], engine_block: int) -> int:
    """Tokens the router predicts cached: whole engine blocks, at least one prompt token
    left to compute (as vLLM caps a hit)."""
    held = residency.longest_prefix(keyed(prompt), {}) * ROUTER_BLOCK
    return min(held, (len(prompt) - 1)) // engine_block * engine_block


def replay(residency: ExactResidency, step: dict[str, Any]) -> None:
    for batch in step["batches"]:
        payload = msgspec.msgpack.encode([0.0, batch, None])
        residency.apply(0, decode_batch(payload).events)


def test_the_recording_is_a_hybrid_engines() -> None:
    events = [e for s in steps() for b in s["batches"] for e in b]
    kinds = {(e.get("group_idx"), e.get("kv_cache_spec_kind")) for e in events if "group_idx" in e}
    assert kinds >= {(0, "sliding_window"), (1, "sliding_window"), (2, "full_attention")}


@pytest.mark.parametrize("windows", [True, False], ids=["every-group", "full-attention-only"])
def test_predicted_cached_tokens_equal_the_engines_on_a_hybrid_layout(windows: bool) -> None:
    residency = ExactResidency(10_000, MODEL, ttl_s=5.0, block_tokens=ROUTER_BLOCK)
    pairs = []
    for step in steps():
        pairs.append(
            (step["step"], predicted(residency, step["prompt"], 32), step["cached_tokens"])
        )
        if windows:
            replay(residency, step)
        else:  # the router before: sliding-window groups' events not read
            for batch in step["batches"]:
                kept = [e for e in batch if e.get("kv_cache_spec_kind") != "sliding_window"]
                residency.apply(0, decode_batch(msgspec.msgpack.encode([0.0, kept, None])).events)
    wrong = [(name, p, r) for name, p, r in pairs if p != r]
    if windows:
        assert wrong == []
    else:
        # Full attention holds the four blocks Q shares with P; the window groups hold
        # none of the window before where they part, so the engine hit nothing.
        assert ("Q = P[:128]+other", 128, 0) in wrong


def test_a_window_groups_store_is_read_though_its_tokens_span_more_blocks() -> None:
    step = steps()[2]  # P+X: the window groups name two blocks, their tokens span four
    (windowed,) = [
        e for b in step["batches"] for e in b if e.get("group_idx") == 0 and e["block_hashes"]
    ]
    assert len(windowed["token_ids"]) > len(windowed["block_hashes"]) * windowed["block_size"]
    (event,) = decode_batch(msgspec.msgpack.encode([0.0, [windowed], None])).events
    assert isinstance(event, BlockStored)
    assert (event.windowed, event.sliding_window, event.group_idx) == (True, 64, 0)


def window_store(hashes: tuple[int, ...], group: int | None = 0) -> BlockStored:
    return BlockStored(hashes, None, (), BLOCK_SIZE, None, "GPU", None, group, WINDOW)


BLOCK_SIZE = ROUTER_BLOCK  # engine blocks of the router's size, for the unit tests below
WINDOW = 2 * ROUTER_BLOCK + 1  # a hit needs the window's two blocks


def full_store(ids: list[int]) -> BlockStored:
    count = len(ids) // BLOCK_SIZE
    return BlockStored(tuple(range(100, 100 + count)), None, tuple(ids), BLOCK_SIZE, None, "GPU")


def test_a_window_block_is_named_when_full_attention_announces_it_in_a_later_piece() -> None:
    residency = ExactResidency(10_000, MODEL, ttl_s=0.0)
    ids = list(range(1, 6 * BLOCK_SIZE + 1))
    residency.apply(0, [window_store((103, 104))])  # the batch's first piece
    assert residency.longest_prefix(keyed(ids), {}) == 0
    residency.apply(0, [full_store(ids)])  # the next piece: full attention
    assert residency.longest_prefix(keyed(ids), {}) == 5


def test_the_window_scan_finds_what_checking_every_end_finds() -> None:
    """``limit`` scans back once; the slow way checks every end's window."""
    rng = random.Random(5)
    ids = list(range(1, 40 * BLOCK_SIZE + 1))
    hashes = keyed(ids)
    for _ in range(200):
        residency = ExactResidency(10_000, MODEL, ttl_s=0.0)
        kept = tuple(100 + i for i in range(40) if rng.random() < 0.4)
        residency.apply(0, [full_store(ids), window_store(kept)])
        held = {hashes[h - 100] for h in kept}
        expected = max(n for n in range(41) if all(h in held for h in hashes[max(0, n - 2) : n]))
        assert residency.longest_prefix(hashes, {}) == expected


def test_window_groups_are_bounded_and_need_their_index() -> None:
    residency = ExactResidency(10_000, MODEL, ttl_s=0.0)
    residency.apply(0, [window_store((1,), group=g) for g in range(MAX_GROUPS + 10)])
    residency.apply(0, [window_store((1,), group=None)])
    assert residency.windows.dropped == 11
