"""The capacity reference: per-worker LRU block pools under perfect session affinity."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest

from bench.replay.conversation import Conversation, tokenize_prompt, tokenize_reply
from bench.replay.oracle import PrefixOracle
from bench.replay.reference import (
    CapacityReference,
    ReferenceParams,
    capacity_reference,
    hindsight_placement,
    synthetic_reply,
)
from bench.replay.result import RequestRecord
from bench.sim.kv_cache import BlockPool
from bench.sim.request import SimRequest
from bench.sim.scheduler import Scheduler
from bench.textgen import generated_text
from bench.workloads.agent import AgentParams, generate
from bench.workloads.sampling import LogNormal
from bench.workloads.trace import Turn, group_sessions
from router.wire.blocks import TOKEN_BYTES

BLOCK = 4  # tokens; small so every block can be counted by hand


def _tokens(seed: int, count: int) -> bytes:
    """``count`` distinct stand-in tokens, different for each seed."""
    return b"".join((seed * 1_000_003 + i).to_bytes(TOKEN_BYTES, "little") for i in range(count))


def _reference(workers: int, kv_blocks: int) -> CapacityReference:
    return CapacityReference(ReferenceParams(workers, kv_blocks * BLOCK, BLOCK))


def test_params_need_a_worker_and_a_block() -> None:
    with pytest.raises(ValueError, match="workers"):
        ReferenceParams(0, 64, BLOCK)
    with pytest.raises(ValueError, match="one block"):
        ReferenceParams(1, BLOCK - 1, BLOCK)
    assert ReferenceParams(1, 4 * BLOCK + 3, BLOCK).num_blocks == 4


def test_a_session_that_fits_hits_its_whole_context() -> None:
    ref = _reference(workers=1, kv_blocks=16)
    prompt0, reply0 = _tokens(1, 8), _tokens(2, 5)  # KV: 8 + 5 - 1 = 12 tokens, 3 blocks
    assert ref.observe("a", 0, prompt0, reply0) == 0
    prompt1 = prompt0 + reply0 + _tokens(3, 7)
    assert ref.observe("a", 1, prompt1, _tokens(4, 5)) == 12
    prompt2 = prompt1 + _tokens(4, 5) + _tokens(5, 3)  # 28 tokens, 24 + 4 - 1 = 27 cached
    assert ref.observe("a", 2, prompt2, _tokens(6, 1)) == 24
    result = ref.result()
    assert result.prompt_tokens == 8 + 20 + 28
    assert result.hit_tokens == 36
    assert result.hits == {("a", 0): 0, ("a", 1): 12, ("a", 2): 24}
    assert result.hit_rate == pytest.approx(36 / 56)


def _two_sessions(ref: CapacityReference) -> tuple[int, int]:
    """A0, B0, A1, B1; each turn 0 leaves 4 blocks (12 + 5 - 1 = 16 tokens)."""
    a0, b0 = _tokens(10, 12), _tokens(20, 12)
    a_reply, b_reply = _tokens(11, 5), _tokens(21, 5)
    ref.observe("a", 0, a0, a_reply)
    ref.observe("b", 0, b0, b_reply)
    a1 = ref.observe("a", 1, a0 + a_reply + _tokens(12, 4), b"")
    b1 = ref.observe("b", 1, b0 + b_reply + _tokens(22, 4), b"")
    return a1, b1


def test_sessions_that_overflow_one_worker_both_hit_on_two() -> None:
    # 8 blocks of context against 6 per worker.
    assert _two_sessions(_reference(workers=2, kv_blocks=6)) == (16, 16)
    one_a, one_b = _two_sessions(_reference(workers=1, kv_blocks=6))
    assert one_a < 16 and one_b < 16


@pytest.mark.parametrize(("newcomer_blocks", "kept_tokens"), [(3, 12), (4, 8), (6, 0)])
def test_lru_evicts_the_idle_sessions_tail_first(newcomer_blocks: int, kept_tokens: int) -> None:
    ref = _reference(workers=1, kv_blocks=6)
    a0, a_reply = _tokens(10, 12), _tokens(11, 5)
    ref.observe("a", 0, a0, a_reply)  # blocks 0-3 cached; 2 never-used blocks lead the queue
    # The newcomer takes the 2 empty blocks first, then a's blocks from its last one back.
    ref.observe("b", 0, _tokens(20, newcomer_blocks * BLOCK), b"")
    assert ref.observe("a", 1, a0 + a_reply + _tokens(12, 4), b"") == kept_tokens


def test_a_shared_system_prompt_hits_across_sessions_on_one_worker() -> None:
    system = _tokens(1, 10)
    for workers, expected in ((1, 8), (2, 0)):
        ref = _reference(workers=workers, kv_blocks=32)
        ref.observe("a", 0, system + _tokens(2, 6), _tokens(3, 4))
        assert ref.observe("b", 0, system + _tokens(4, 6), b"") == expected


def test_the_last_generated_token_does_not_complete_a_block() -> None:
    prompt, more = _tokens(1, 8), _tokens(9, 4)
    for reply_tokens, expected in ((4, 8), (5, 12)):
        ref = _reference(workers=1, kv_blocks=16)
        reply = _tokens(2, reply_tokens)
        ref.observe("a", 0, prompt, reply)
        assert ref.observe("a", 1, prompt + reply + more, b"") == expected


def test_a_hit_leaves_the_last_prompt_token_to_compute() -> None:
    ref = _reference(workers=1, kv_blocks=16)
    prompt = _tokens(1, 12)
    ref.observe("a", 0, prompt, b"")
    assert ref.observe("b", 0, prompt, b"") == 8  # 3 blocks cached, but within 11 tokens


def test_a_request_larger_than_the_pool_caches_its_head() -> None:
    ref = _reference(workers=1, kv_blocks=3)
    prompt = _tokens(1, 20)
    ref.observe("a", 0, prompt, _tokens(2, 8))
    assert ref.observe("a", 1, prompt + _tokens(3, 4), b"") == 12


def test_new_sessions_go_to_the_worker_sent_the_fewest_prompt_tokens() -> None:
    ref = _reference(workers=3, kv_blocks=64)
    ref.observe("a", 0, _tokens(1, 100), b"")  # tie: lowest index -> 0 (100)
    ref.observe("b", 0, _tokens(2, 60), b"")  # -> 1 (60)
    ref.observe("c", 0, _tokens(3, 50), b"")  # -> 2 (50)
    # b stays on 1 although 2 has the least, and hits what its turn 0 left there.
    assert ref.observe("b", 1, _tokens(2, 90), b"") == 60  # 1: 150
    ref.observe("d", 0, _tokens(4, 10), b"")  # -> 2 (60)
    ref.observe("e", 0, _tokens(5, 45), b"")  # -> 2 (105)
    ref.observe("f", 0, _tokens(6, 10), b"")  # 0 (100) < 2 (105) < 1 (150)
    assert ref.result().placement == {"a": 0, "b": 1, "c": 2, "d": 2, "e": 2, "f": 0}


# --- from a trace and a run's records -----------------------------------------------------


def _agent_trace() -> list[Turn]:
    params = AgentParams(
        sessions=6,
        rate=0.5,
        turns=LogNormal(median=8, sigma=0.3, low=3, high=12),
        system_prompts=(300, 500),
        first_user=LogNormal(median=200, sigma=0.5, low=50, high=400),
        tool_result=LogNormal(median=300, sigma=0.8, low=20, high=2000),
        output=LogNormal(median=60, sigma=0.5, low=10, high=200),
        max_context_tokens=8000,
    )
    return generate(params, seed=3)


def _records(
    turns: Sequence[Turn], failed: frozenset[tuple[str, int]] = frozenset()
) -> list[RequestRecord]:
    """What a closed-loop replay records: a turn starts after the previous one ended."""
    records = []
    for session in group_sessions(turns):
        start = session.arrival
        for turn in session.turns:
            start += turn.gap
            error = "boom" if (turn.session, turn.turn) in failed else None
            records.append(
                RequestRecord(
                    session=turn.session,
                    turn=turn.turn,
                    start=start,
                    ttft_s=0.1,
                    latency_s=2.0,
                    prompt_tokens=0,
                    cached_tokens=0,
                    oracle_cached_tokens=0,
                    completion_tokens=turn.output_tokens,
                    worker=None,
                    error=error,
                    status=200 if error is None else 500,
                )
            )
            start += 2.0
    return records


def _ordered_requests(
    turns: Sequence[Turn], records: Sequence[RequestRecord], reply_for: dict[tuple[str, int], str]
) -> list[tuple[str, int, bytes, bytes]]:
    """(session, turn, prompt, reply) of the successful records in start order."""
    by_key = {(t.session, t.turn): t for t in turns}
    conversations = {s.id: Conversation(s.turns[0].system) for s in group_sessions(turns)}
    out = []
    for r in sorted((r for r in records if r.ok), key=lambda r: (r.start, r.session, r.turn)):
        messages = conversations[r.session].request(by_key[(r.session, r.turn)])
        reply = reply_for[(r.session, r.turn)]
        conversations[r.session].commit(messages, reply)
        out.append((r.session, r.turn, tokenize_prompt(messages), tokenize_reply(reply)))
    return out


def _oracle_hit_rate(requests: Sequence[tuple[str, int, bytes, bytes]]) -> float:
    oracle, hits, total = PrefixOracle(), 0, 0
    for _, _, prompt, reply in requests:
        hits += oracle.hit_tokens(prompt)
        total += len(prompt) // TOKEN_BYTES
        oracle.observe_prompt(prompt)
        oracle.observe_completion(prompt, reply)
    return hits / total


def test_offline_reference_matches_one_fed_the_engines_own_replies() -> None:
    turns = _agent_trace()
    failed = frozenset({(turns[3].session, turns[3].turn)})
    records = _records(turns, failed)
    rng = random.Random(99)  # the engine draws fresh text for every reply
    replies = {(t.session, t.turn): generated_text(rng, t.output_tokens) for t in turns}
    params = ReferenceParams(workers=2, kv_tokens=6000)
    online = CapacityReference(params)
    for request in _ordered_requests(turns, records, replies):
        online.observe(*request)
    offline = capacity_reference(turns, records, params, hindsight=False)
    assert offline.hits == online.result().hits
    assert failed.isdisjoint(offline.hits)
    assert 0 < offline.hit_rate < 1
    hindsight = capacity_reference(turns, records, params)
    placed = CapacityReference(params, hindsight_placement(records, 2))
    for request in _ordered_requests(turns, records, replies):
        placed.observe(*request)
    assert hindsight.hits == placed.result().hits


def _peak_record(session: str, prompt: int) -> RequestRecord:
    return RequestRecord(
        session=session,
        turn=0,
        start=0.0,
        ttft_s=0.1,
        latency_s=1.0,
        prompt_tokens=prompt,
        cached_tokens=0,
        oracle_cached_tokens=0,
        completion_tokens=0,
        worker=None,
        error=None,
        status=200,
    )


def test_hindsight_placement_balances_peak_contexts() -> None:
    sizes = {"a": 90, "b": 60, "c": 50, "d": 40, "e": 30}
    placement = hindsight_placement([_peak_record(s, n) for s, n in sizes.items()], 2)
    loads = [sum(n for s, n in sizes.items() if placement[s] == w) for w in range(2)]
    assert sorted(loads) == [130, 140]  # LPT: a+d = 130 / b+c+e = 140 (causal: a+c+e)


def test_one_request_at_a_time_the_simulated_engine_hits_the_same() -> None:
    """The reference's pool bookkeeping against the simulator's own scheduler."""
    turns, kv_tokens = _agent_trace(), 600 * 16  # less than the sessions need together
    scheduler = Scheduler(BlockPool(kv_tokens // 16, 16), 8, 2048)
    ref = CapacityReference(ReferenceParams(1, kv_tokens))
    by_key = {(t.session, t.turn): t for t in turns}
    conversations = {s.id: Conversation(s.turns[0].system) for s in group_sessions(turns)}
    records = sorted(_records(turns), key=lambda r: (r.start, r.session, r.turn))
    engine_hits = 0
    for index, record in enumerate(records):
        messages = conversations[record.session].request(by_key[(record.session, record.turn)])
        prompt = tokenize_prompt(messages)
        request = SimRequest(
            f"r{index}", prompt, record.completion_tokens, 0.0, 16, random.Random(index)
        )
        scheduler.add(request)
        while not request.finished:
            scheduler.complete(scheduler.schedule(), 0.0)
        reply = request.output_text()
        conversations[record.session].commit(messages, reply)
        hit = ref.observe(record.session, record.turn, prompt, tokenize_reply(reply))
        assert hit == request.cached_tokens, (record.session, record.turn)
        engine_hits += hit
    unlimited = capacity_reference(turns, records, ReferenceParams(1, 2_000_000))
    assert 0 < engine_hits < unlimited.hit_tokens - 5000  # evictions happened, and matched


def test_huge_capacity_is_the_oracle_and_a_small_one_is_below_it() -> None:
    turns = _agent_trace()
    records = _records(turns)
    replies = {
        (t.session, t.turn): synthetic_reply(t.session, t.turn, t.output_tokens) for t in turns
    }
    oracle = _oracle_hit_rate(_ordered_requests(turns, records, replies))
    assert oracle > 0.5
    huge = 2_000_000
    assert capacity_reference(turns, records, ReferenceParams(1, huge)).hit_rate == oracle
    spread = capacity_reference(turns, records, ReferenceParams(3, huge))
    assert oracle - 0.05 < spread.hit_rate < oracle  # each worker pays the system prompt once
    small = capacity_reference(turns, records, ReferenceParams(3, 4000))
    assert small.hit_rate < spread.hit_rate - 0.05


def test_a_record_outside_the_trace_is_an_error() -> None:
    turns = _agent_trace()
    records = _records(turns)
    records[0] = replace(records[0], session="nobody")
    with pytest.raises(ValueError, match="nobody"):
        capacity_reference(turns, records, ReferenceParams(1, 4000))


def test_the_trace_order_reference_is_the_same_whatever_order_the_run_took() -> None:
    """A slow router's closed-loop run interleaves sessions less; the trace's order gives
    every router on the same trace one yardstick, the run's order (the default) does not."""
    turns = _agent_trace()
    records = _records(turns)
    # The same requests, but each session's turns bunched together, one session after
    # another (as a router that leaves sessions waiting in queues would make them).
    bunched, clock = [], 0.0
    for record in sorted(records, key=lambda r: (r.session, r.turn)):
        clock += 1.0
        bunched.append(replace(record, start=clock))
    params = ReferenceParams(workers=1, kv_tokens=4000)
    in_trace_order = capacity_reference(turns, records, params, order="trace")
    assert capacity_reference(turns, bunched, params, order="trace").hits == in_trace_order.hits
    as_run = capacity_reference(turns, bunched, params)
    assert as_run.hit_rate > in_trace_order.hit_rate  # less interleaving, fewer evictions
