"""The block pool and scheduler on plain values: no clock, no HTTP."""

from __future__ import annotations

import random

from bench.sim.kv_cache import BlockPool
from bench.sim.request import SimRequest, Status
from bench.sim.scheduler import Scheduler
from bench.tokenizer import encode_piece

BLOCK = 16


def prompt_of(tokens: int, key: str) -> bytes:
    """``tokens`` tokens of text unique to ``key`` (4 bytes a token)."""
    rng = random.Random(key)
    return encode_piece("".join(rng.choice("abcdefgh") for _ in range(tokens * 4)))


def request(prompt: bytes, output: int = 1, rid: str = "r") -> SimRequest:
    return SimRequest(rid, prompt, output, 0.0, BLOCK, random.Random(0))


def run_to_completion(scheduler: Scheduler, *requests: SimRequest, limit: int = 10_000) -> int:
    for r in requests:
        scheduler.add(r)
    steps = 0
    while scheduler.has_work:
        scheduler.complete(scheduler.schedule(), float(steps))
        steps += 1
        assert steps < limit, "scheduler made no progress"
    return steps


def make_scheduler(blocks: int, seqs: int = 8, budget: int = 8192) -> Scheduler:
    return Scheduler(BlockPool(blocks, BLOCK), seqs, budget)


def test_repeated_prompt_hits_all_full_blocks_but_the_last_token() -> None:
    scheduler = make_scheduler(64)
    prompt = prompt_of(160, "a")  # exactly 10 blocks
    first, second = request(prompt), request(prompt)
    run_to_completion(scheduler, first)
    run_to_completion(scheduler, second)
    assert first.cached_tokens == 0
    # A hit never covers the last prompt token, so the 10th block is recomputed.
    assert second.cached_tokens == 144


def test_extended_prompt_hits_prompt_and_generated_blocks() -> None:
    scheduler = make_scheduler(64)
    prompt = prompt_of(100, "a")
    first = request(prompt, output=40)
    run_to_completion(scheduler, first)
    # The next turn carries the whole first turn, its reply and more.
    extended = bytes(first.tokens) + prompt_of(50, "b")
    second = request(extended)
    run_to_completion(scheduler, second)
    computed = 100 + 40 - 1  # the last sampled token never had its KV computed
    assert second.cached_tokens == computed // BLOCK * BLOCK


def test_idle_longest_loses_its_prefix_first_tail_first() -> None:
    scheduler = make_scheduler(40)
    a, b, c = (prompt_of(160, k) for k in "abc")  # 10 blocks each
    for p in (a, b, c):
        run_to_completion(scheduler, request(p))
    run_to_completion(scheduler, request(a))  # a is now the most recently used
    run_to_completion(scheduler, request(prompt_of(160, "d")))  # pressure: evicts 10 blocks
    hits = {}
    for key, p in (("c", c), ("a", a), ("b", b)):
        probe = request(p)
        run_to_completion(scheduler, probe)
        hits[key] = probe.cached_tokens
    assert hits["c"] == 144 and hits["a"] == 144
    # b was idle longest: it lost blocks, and from its tail, so its head still hits.
    assert 0 < hits["b"] < 144


def test_chunked_prefill_respects_the_token_budget() -> None:
    scheduler = make_scheduler(256, budget=512)
    r = request(prompt_of(2000, "long"), output=2)
    scheduler.add(r)
    chunks = []
    while r.output_tokens == 0:
        plan = scheduler.schedule()
        chunks.append(sum(new for _, new, _ in plan.work))
        scheduler.complete(plan, 0.0)
    assert chunks == [512, 512, 512, 464]


def test_max_num_seqs_keeps_the_rest_waiting_fcfs() -> None:
    scheduler = make_scheduler(256, seqs=2)
    reqs = [request(prompt_of(20, str(i)), output=5, rid=str(i)) for i in range(3)]
    for r in reqs:
        scheduler.add(r)
    scheduler.complete(scheduler.schedule(), 0.0)
    assert [r.status for r in reqs] == [Status.RUNNING, Status.RUNNING, Status.WAITING]
    run_to_completion(scheduler)
    assert all(r.output_tokens == 5 for r in reqs)


def test_preemption_takes_the_newest_and_everything_still_finishes() -> None:
    # 12 blocks; each request needs 2 prompt blocks and grows to 6.
    scheduler = make_scheduler(12, seqs=8)
    reqs = [request(prompt_of(30, str(i)), output=60, rid=str(i)) for i in range(4)]
    for r in reqs:
        scheduler.add(r)
    preempted: list[SimRequest] = []
    steps = 0
    while scheduler.has_work:
        plan = scheduler.schedule()
        preempted += plan.preempted
        scheduler.complete(plan, float(steps))
        steps += 1
        assert steps < 10_000
    assert preempted, "the pool was too small not to preempt"
    assert preempted[0] is reqs[-1]
    assert all(r.output_tokens == 60 and r.finish_reason == "length" for r in reqs)
    assert scheduler.pool.num_free == 12


def test_abort_releases_blocks() -> None:
    scheduler = make_scheduler(32)
    r = request(prompt_of(100, "x"), output=50)
    scheduler.add(r)
    scheduler.complete(scheduler.schedule(), 0.0)
    assert scheduler.pool.num_free < 32
    scheduler.abort(r)
    assert scheduler.pool.num_free == 32 and r.finish_reason == "abort"
    assert not scheduler.has_work


def test_usage_counts_pinned_blocks_only() -> None:
    pool = BlockPool(10, BLOCK)
    blocks = pool.allocate(4)
    assert pool.usage() == 0.4
    pool.register(blocks[0], 123)
    pool.release(blocks)
    assert pool.usage() == 0.0
    assert pool.cached_prefix([123, 456], 2) == [blocks[0]]
