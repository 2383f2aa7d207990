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
    # Pressure: 15 blocks where 10 are free (and a's partial recompute, reused first).
    run_to_completion(scheduler, request(prompt_of(240, "d")))
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


def _step_by_step(scheduler: Scheduler, requests: list[SimRequest]) -> None:
    for r in requests:
        scheduler.add(r)
    steps = 0
    while scheduler.has_work:
        plan = scheduler.schedule()
        steps += 1
        scheduler.complete(plan, float(steps))
        assert steps < 10_000, "scheduler made no progress"


def _by_spans(scheduler: Scheduler, requests: list[SimRequest], limit: int) -> int:
    """The engine's way: one span of decode steps at a time, applied in two pieces."""
    for r in requests:
        scheduler.add(r)
    steps = spans = 0
    while scheduler.has_work:
        plan = scheduler.schedule()
        span = scheduler.decode_span(plan, limit)
        times = [float(steps + i + 1) for i in range(span)]
        steps += span
        spans += 1
        assert steps < 10_000, "scheduler made no progress"
        if span == 1:
            scheduler.complete(plan, times[0])
            continue
        half = span // 2
        scheduler.complete_decode(plan, 0, times[:half])
        scheduler.complete_decode(plan, half, times[half:])
    return spans


def _state(scheduler: Scheduler, requests: list[SimRequest]) -> object:
    """What a later request can observe: the tokens, their times, the cached prefixes
    and the LRU order of what is cached (block ids themselves may be handed out in
    another order)."""
    pool = scheduler.pool
    return (
        [
            (bytes(r.tokens), r.token_times, r.cached_tokens, r.num_preemptions, r.finish_reason)
            for r in requests
        ],
        sorted(pool._cached),
        [pool._hash[b] for b in pool.free_blocks()],
    )


def test_decode_spans_give_the_same_result_as_single_steps() -> None:
    """Spans must not change what the engine does: the same tokens at the same step
    times, the same cache contents and LRU order, under block pressure (preemption)."""

    def workload() -> list[SimRequest]:
        return [
            SimRequest(
                f"r{i}",
                prompt_of(40 + 37 * i, f"p{i % 3}"),
                30 + 17 * i,
                0.0,
                BLOCK,
                random.Random(i),
            )
            for i in range(6)
        ]

    single, spanned = make_scheduler(30, seqs=4), make_scheduler(30, seqs=4)
    reference, candidate = workload(), workload()
    _step_by_step(single, reference)
    spans = _by_spans(spanned, candidate, limit=1000)
    assert _state(spanned, candidate) == _state(single, reference)
    assert sum(len(r.token_times) for r in candidate) > 2 * spans  # spans were used
    assert any(r.num_preemptions for r in reference)  # the pressure case was exercised


def test_decode_span_stops_where_blocks_run_out_and_at_the_first_finish() -> None:
    scheduler = make_scheduler(12)
    long, short = (
        request(prompt_of(64, "a"), output=200, rid="l"),
        request(prompt_of(64, "b"), output=50, rid="s"),
    )
    scheduler.add(long)
    scheduler.add(short)
    scheduler.complete(scheduler.schedule(), 1.0)  # both prefilled, first tokens out
    plan = scheduler.schedule()
    # 12 blocks: 5 each held (64 tokens + 1 token), 2 free -> 32 more tokens of room
    # for the two together, so the span ends before the short request's finish.
    span = scheduler.decode_span(plan, 1000)
    assert scheduler._decode_blocks(plan.work, span) <= scheduler.pool.num_free
    assert scheduler._decode_blocks(plan.work, span + 1) > scheduler.pool.num_free
    roomy = make_scheduler(200)
    long, short = (
        request(prompt_of(64, "a"), output=200, rid="l"),
        request(prompt_of(64, "b"), output=50, rid="s"),
    )
    roomy.add(long)
    roomy.add(short)
    roomy.complete(roomy.schedule(), 1.0)
    assert roomy.decode_span(roomy.schedule(), 1000) == 49  # the short one's last token
