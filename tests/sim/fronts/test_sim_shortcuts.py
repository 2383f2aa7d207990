"""The simulated engine's shortcuts against the straightforward computations they stand
in for: the block pool's lazy free queue against an ordered dict, reused prompt hashes
against hashing from scratch, tokens sampled ahead against sampling each step, chunk
templates against encoding each chunk, histogram bucketing by binary search against
prometheus_client's own, and events sharing a write against one write each."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

import aiohttp
import orjson
import pytest

from bench.sim.kv_cache import NO_HASH, BlockPool
from bench.sim.openai_api import ChunkEvents, sse_event, stream_chunk
from bench.sim.prefix_hashes import PrefixHashes
from bench.sim.request import DRAW_AHEAD_TOKENS, SimRequest
from bench.textgen import generated_text
from router.wire.blocks import TOKEN_BYTES, token_block_hashes
from router.wire.kinds import PromptKind
from tests.conftest import TEST_MODEL, RunningEngine

BLOCK = 16


class OrderedDictPool:
    """The block pool as it was first written: the free queue an ordered dict."""

    def __init__(self, num_blocks: int) -> None:
        self.ref = [0] * num_blocks
        self.hash = [NO_HASH] * num_blocks
        self.cached: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    def cached_prefix(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        found = []
        for h in hashes[:max_blocks]:
            if h not in self.cached:
                break
            found.append(self.cached[h])
        return found

    def touch(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def allocate(self, count: int) -> list[int]:
        blocks = []
        for _ in range(count):
            b, _ = self.free.popitem(last=False)
            h = self.hash[b]
            if h != NO_HASH:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.hash[b] = NO_HASH
            self.ref[b] = 1
            blocks.append(b)
        return blocks

    def register(self, block: int, block_hash: int) -> None:
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            self.hash[block] = block_hash

    def release(self, blocks: Sequence[int]) -> None:
        """Cached blocks to the tail, last first; the others to the head, reused first."""
        first = []
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash[b] == NO_HASH:
                    first.append(b)
                else:
                    self.free[b] = None
        for b in reversed(first):
            self.free[b] = None
            self.free.move_to_end(b, last=False)


def test_block_pool_keeps_the_lru_order_of_an_ordered_dict() -> None:
    """Requests over a few shared prefixes on a small pool: hits on free blocks (which
    leave stale queue entries), evictions, shared blocks released twice, and enough
    hits without allocations in between that the queue is compacted."""
    rng = random.Random(7)
    pool, model = BlockPool(12, BLOCK), OrderedDictPool(12)
    held: list[list[int]] = []
    hits_on_free = compactions = 0
    for _ in range(6000):
        if held and (rng.random() < 0.45 or pool.num_free == 0):
            blocks = held.pop(rng.randrange(len(held)))
            queued, free = len(pool._queue), len(model.free)
            pool.release(blocks)
            model.release(blocks)
            compactions += queued + len(model.free) - free > 2 * pool.num_blocks
            assert pool.free_blocks() == list(model.free)
            continue
        family, length = rng.randrange(3), rng.randint(1, 5)
        hashes = [hash((family, i)) for i in range(length)]
        most = length - rng.randrange(2)  # a whole hit allocates nothing
        hit, free = pool.prefix_hit(hashes, most)
        assert hit == model.cached_prefix(hashes, most) == pool.cached_prefix(hashes, most)
        assert free == sum(1 for b in hit if model.ref[b] == 0) == pool.free_among(hit)
        need = length - len(hit)
        if need + free > pool.num_free:
            continue
        hits_on_free += free
        pool.touch(hit)
        model.touch(hit)
        blocks = hit + pool.allocate(need)
        assert blocks == hit + model.allocate(need)
        pool.register_blocks(blocks[len(hit) :], hashes[len(hit) :])
        for block, block_hash in zip(blocks[len(hit) :], hashes[len(hit) :], strict=True):
            model.register(block, block_hash)
        held.append(blocks)
        assert pool.free_blocks() == list(model.free)
        assert pool.num_free == len(model.free)
        assert pool._cached == model.cached and pool._hash == model.hash
    assert hits_on_free > 1000 and compactions > 5


def test_block_pool_queue_stays_bounded_under_hits_alone() -> None:
    """The same blocks hit and released over and over, nothing allocated: every hit
    leaves a stale entry behind, and compaction must drop them."""
    pool = BlockPool(4, BLOCK)
    blocks = pool.allocate(4)
    pool.register_blocks(blocks, [11, 12, 13, 14])
    pool.release(blocks)
    for _ in range(100):
        hit, free = pool.prefix_hit([11, 12, 13, 14], 4)
        assert hit == blocks and free == 4
        pool.touch(hit)
        pool.release(hit)
        assert len(pool._queue) <= 2 * pool.num_blocks + len(hit)
    assert pool.free_blocks() == blocks[::-1]
    assert pool.allocate(4) == blocks[::-1]


def _prompt(rng: random.Random, tokens: int) -> bytes:
    return bytes(rng.getrandbits(8) for _ in range(tokens * TOKEN_BYTES))


def test_prefix_hashes_equal_hashing_each_prompt_from_scratch() -> None:
    rng = random.Random(3)
    hasher = PrefixHashes(BLOCK, capacity=3)
    base = _prompt(rng, 100)
    prompts = [
        base,
        base + _prompt(rng, 50),  # the next turn
        base + _prompt(rng, 50),  # another next turn of the same first one
        base,  # the same prompt again
        base[:-40],  # shorter, ending mid-block
        base[: 3 * BLOCK * TOKEN_BYTES] + _prompt(rng, 60),  # diverges at a block edge
        base[: 3 * BLOCK * TOKEN_BYTES + 8] + _prompt(rng, 60),  # diverges inside a block
        base[:10],  # no full block
        _prompt(rng, 5) + base,  # another first block
    ]
    prompts += [rng.choice(prompts)[: rng.randrange(1, 600)] + _prompt(rng, 20) for _ in range(200)]
    for prompt in prompts:
        for parent in (0, 99):
            hashes = hasher.hashes(prompt, parent)
            assert hashes == token_block_hashes(prompt, BLOCK, parent)
            hashes.reverse()  # the list is the caller's to change
    assert len(hasher._seen) <= 3


def test_prefix_hashes_reuse_the_turn_before() -> None:
    hasher = PrefixHashes(BLOCK)
    first = bytes(range(256)) * 10
    hasher.hashes(first)
    key = (0, first[: BLOCK * TOKEN_BYTES])
    assert hasher._blocks_in_common(first + b"more", hasher._seen[key][0]) == len(first) // 64


@pytest.mark.parametrize("counts", [[1] * 600, [3, 16, 1, 40, 700, 2, 1], [999, 1]])
def test_tokens_sampled_ahead_are_the_tokens_sampled_each_step(counts: list[int]) -> None:
    rng = random.Random(0)
    prompt = _prompt(rng, 37)  # two full blocks and a partial one
    total = sum(counts)
    request = SimRequest("r", prompt, total, 0.0, BLOCK, random.Random(5), parent_hash=42)
    drawn = 0
    for count in counts:
        request.append_generated(BLOCK, count)
        drawn += count
        output = generated_text(random.Random(5), drawn).encode("ascii")
        assert bytes(request.output) == output
        assert request.tokens == prompt + output
        assert request.num_tokens == 37 + drawn
        assert request.hashes == token_block_hashes(prompt + output, BLOCK, 42)
    assert request.output_text(7) == output[7 * TOKEN_BYTES :].decode("ascii")
    assert total > DRAW_AHEAD_TOKENS  # it was sampled in more than one batch


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("finish", [None, "length", "stop"])
@pytest.mark.parametrize("model", ["m", "\x00", 'm\x00"odel\\'])
def test_chunk_events_are_the_bytes_of_encoding_each_chunk(
    kind: PromptKind, finish: str | None, model: str
) -> None:
    """Model names that hold the template's own marker must not confuse it."""
    rid = "chatcmpl-0123"
    events = ChunkEvents(kind, rid, model, 1_700_000_000)
    for text in ("", "word", 'a "quote" \\ and \x00', "ünïcödé ✓\n", "x" * 500):
        expected = sse_event(stream_chunk(kind, rid, model, 1_700_000_000, text, finish))
        assert events.text(text, finish) == expected
        assert orjson.loads(expected[len(b"data: ") :])["model"] == model


async def test_a_stream_is_whole_events_in_vllms_order(sim: RunningEngine) -> None:
    """Events due at once share a write; on the wire each is still one ``data:`` line
    and a blank one: the role chunk, the text chunks, the last with its finish reason,
    the usage, ``[DONE]``."""
    body = {
        "model": TEST_MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 30,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{sim.url}/v1/chat/completions", json=body) as response,
    ):
        raw = await response.read()
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    assert all(e.startswith(b"data: {") and b"\n" not in e for e in events[:-2])
    chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    texts = [c["choices"][0] for c in chunks[1:-1]]
    assert len(texts) >= 2 and all(t["finish_reason"] is None for t in texts[:-1])
    assert texts[-1]["finish_reason"] == "length" and texts[-1]["stop_reason"] is None
    assert len("".join(t["delta"]["content"] for t in texts)) == 30 * TOKEN_BYTES
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 30
    assert len({c["id"] for c in chunks}) == 1
