"""The qa and burst generators: shapes, the CLI, the stats, and how a replay runs them."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.replay.conversation import Conversation
from bench.replay.runner import ReplayConfig, replay, select_sessions
from bench.workloads import burst, qa
from bench.workloads.sampling import LogNormal
from bench.workloads.stats import describe, summarize
from bench.workloads.trace import (
    Session,
    TextBlock,
    Turn,
    group_sessions,
    read_trace,
    render_text,
    text_tokens,
)
from tests.conftest import EngineFactory


def _blocks(turn: Turn) -> tuple[TextBlock, ...]:
    assert not isinstance(turn.user, str)
    return turn.user


def _groups(turns: list[Turn]) -> dict[str, list[Session]]:
    """Burst sessions by group: ``burst-<g>-<m>`` -> ``burst-<g>``."""
    groups: dict[str, list[Session]] = {}
    for session in group_sessions(turns):
        groups.setdefault(session.id.rsplit("-", 1)[0], []).append(session)
    return groups


# --- qa -----------------------------------------------------------------------------


def test_qa_users_share_the_system_prompt_and_own_their_history() -> None:
    params = qa.QaParams()
    sessions = group_sessions(qa.generate(params, 0))
    assert [s.id for s in sessions] == [f"qa-{i}" for i in range(24)]
    system = (TextBlock("qa-sys", 1000),)
    assert {s.turns[0].system for s in sessions} == {system}
    histories = [_blocks(s.turns[0])[0] for s in sessions]
    assert len({h.key for h in histories}) == 24
    assert {h.tokens for h in histories} == {8000}
    assert len({render_text((h,)) for h in histories}) == 24
    # The history opens the first message only; later turns are just the question.
    for s in sessions:
        assert len(s.turns) == 8
        assert [len(_blocks(t)) for t in s.turns] == [2, *[1] * 7]
        assert all(t.system is None for t in s.turns[1:])
    # The first request a replay sends: the shared system message, then the history.
    first, second = (Conversation(s.turns[0].system).request(s.turns[0]) for s in sessions[:2])
    assert first[0] == second[0] == {"role": "system", "content": render_text(system)}
    assert first[1]["content"].startswith(render_text((histories[0],)))


def test_qa_rounds_are_short_questions_with_medium_replies_a_think_time_apart() -> None:
    turns = qa.generate(qa.QaParams(users=100), 1)
    questions = [text_tokens(_blocks(t)[-1:]) for t in turns]
    assert min(questions) >= 50 and max(questions) <= 200
    assert all(100 <= t.output_tokens <= 300 for t in turns)
    gaps = [t.gap for t in turns if t.turn > 0]
    assert min(gaps) >= 3.0 and max(gaps) <= 30.0
    assert all(t.gap == 0.0 for t in turns if t.turn == 0)


def test_qa_users_join_at_a_steady_rate() -> None:
    sessions = group_sessions(qa.generate(qa.QaParams(users=10, interarrival_s=1.5), 0))
    assert [s.arrival for s in sessions] == pytest.approx([1.5 * i for i in range(10)])
    at_once = group_sessions(qa.generate(qa.QaParams(users=3, interarrival_s=0), 0))
    assert [s.arrival for s in at_once] == [0.0, 0.0, 0.0]


def test_qa_more_users_append() -> None:
    assert qa.generate(qa.QaParams(users=10), 5)[:40] == qa.generate(qa.QaParams(users=5), 5)


# --- burst --------------------------------------------------------------------------


def test_burst_members_share_the_prompt_and_arrive_together() -> None:
    params = burst.BurstParams(groups=200)
    turns = burst.generate(params, 0)
    groups = _groups(turns)
    assert len(groups) == 200
    assert len({t.session for t in turns}) == len(turns) == 200 * 8  # one session each
    near = 0
    for members in groups.values():
        assert len(members) == 8
        assert all(len(m.turns) == 1 for m in members)
        blocks = [_blocks(m.turns[0]) for m in members]
        assert len({b[0] for b in blocks}) == 1  # the same prompt block
        assert 2000 <= blocks[0][0].tokens <= 8000
        arrivals = [m.arrival for m in members]
        assert max(arrivals) - min(arrivals) <= params.jitter_s
        if len(blocks[0]) == 2:
            near += 1
            assert all(len(b) == 2 for b in blocks)
            assert len({b[1].key for b in blocks}) == 8
            assert all(8 <= b[1].tokens <= 128 for b in blocks)
        else:
            assert all(len(b) == 1 for b in blocks)
    assert 0.15 <= near / 200 <= 0.35
    outputs = [t.output_tokens for t in turns]
    assert min(outputs) >= 50 and max(outputs) <= 2000
    assert len(set(outputs)) > 100  # each member draws its own reply length


def test_near_identical_members_share_a_prefix_then_differ() -> None:
    params = burst.BurstParams(groups=1, group_size=3, near_fraction=1.0)
    texts = [render_text(t.user) for t in burst.generate(params, 0)]
    prompt = render_text(_blocks(burst.generate(params, 0)[0])[:1])
    assert all(text.startswith(prompt) and len(text) > len(prompt) for text in texts)
    assert len({text[len(prompt) :] for text in texts}) == 3
    identical = burst.BurstParams(groups=1, group_size=3, near_fraction=0.0, jitter_s=0.0)
    turns = burst.generate(identical, 0)
    assert len({render_text(t.user) for t in turns}) == 1
    assert {t.arrival for t in turns} == {0.0}


def test_burst_groups_arrive_as_a_poisson_process_and_more_groups_append() -> None:
    few = burst.generate(burst.BurstParams(groups=5), 2)
    many = burst.generate(burst.BurstParams(groups=400, rate=2.0), 2)
    assert burst.generate(burst.BurstParams(groups=10), 2)[: len(few)] == few
    starts = sorted(min(m.arrival for m in ms) for ms in _groups(many).values())
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert 0.4 <= sum(gaps) / len(gaps) <= 0.6
    assert min(gaps) < 0.1 < 1.0 < max(gaps)  # exponential, not steady


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="rounds"):
        qa.QaParams(rounds=0)
    with pytest.raises(ValueError, match="interarrival"):
        qa.QaParams(interarrival_s=-1)
    with pytest.raises(ValueError, match="history_tokens"):
        qa.QaParams(history_tokens=0)
    with pytest.raises(ValueError, match="group_size"):
        burst.BurstParams(group_size=0)
    with pytest.raises(ValueError, match="near_fraction"):
        burst.BurstParams(near_fraction=1.5)
    with pytest.raises(ValueError, match="rate"):
        burst.BurstParams(rate=0)
    with pytest.raises(ValueError, match="jitter"):
        burst.BurstParams(jitter_s=-0.001)


# --- stats and the CLI --------------------------------------------------------------


def test_stats_count_shared_blocks_once() -> None:
    stats = summarize(qa.generate(qa.QaParams(), 0))
    assert (stats.sessions, stats.multi_turn_sessions, stats.turns) == (24, 24, 192)
    assert stats.median_turns == 8
    assert stats.span_s == pytest.approx(23 * 2.0)
    assert stats.distinct_text_tokens == stats.text_tokens - 23 * 1000
    text = describe(stats)
    assert "24 sessions (24 multi-turn)" in text and "median 8 turns" in text

    params = burst.BurstParams(groups=10, near_fraction=0.0)
    turns = burst.generate(params, 0)
    stats = summarize(turns)
    assert (stats.sessions, stats.multi_turn_sessions, stats.median_turns) == (80, 0, 1)
    assert stats.text_tokens == 8 * stats.distinct_text_tokens
    assert stats.prompt_tokens == stats.text_tokens
    assert f"({stats.distinct_text_tokens:,} distinct)" in describe(stats)


def test_kvrouter_bench_gen_qa(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main

    out = tmp_path / "qa.jsonl"
    argv = ["bench", "gen", "qa", "-o", str(out), "--users", "3", "--interarrival", "5"]
    argv += ["--rounds", "2", "--system-tokens", "300", "--history-tokens", "500"]
    argv += ["--think-time-median", "1"]
    assert main(argv) == 0
    sessions = group_sessions(read_trace(out))
    assert [s.arrival for s in sessions] == [0.0, 5.0, 10.0]
    assert all(len(s.turns) == 2 for s in sessions)
    assert all(text_tokens(s.turns[0].system or "") == 300 for s in sessions)
    assert all(_blocks(s.turns[0])[0].tokens == 500 for s in sessions)
    assert all(t.gap == 1.0 for s in sessions for t in s.turns[1:])
    assert "3 sessions (3 multi-turn)" in capsys.readouterr().out


def test_kvrouter_bench_gen_burst(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main

    out = tmp_path / "burst.jsonl"
    argv = ["bench", "gen", "burst", "-o", str(out), "--groups", "2", "--group-size", "3"]
    argv += ["--near-fraction", "1", "--jitter-ms", "0", "--prompt-tokens-median", "900"]
    assert main(argv) == 0
    turns = read_trace(out)
    assert len(turns) == 6
    for members in _groups(turns).values():
        assert len({m.arrival for m in members}) == 1
        assert all(len(_blocks(m.turns[0])) == 2 for m in members)
    assert "6 sessions (0 multi-turn)" in capsys.readouterr().out


# --- replay -------------------------------------------------------------------------

TIME_SCALE = 20.0


@pytest.fixture
async def engine_url(engine_factory: EngineFactory) -> AsyncIterator[str]:
    async with engine_factory(time_scale=TIME_SCALE) as running:
        yield running.url


async def test_a_replayed_burst_has_its_members_in_flight_together(engine_url: str) -> None:
    fixed = LogNormal(median=64, sigma=0.0, low=64, high=64)
    params = burst.BurstParams(
        groups=2, rate=0.5, group_size=4, prompt=LogNormal(800, 0.0, 800, 800), output=fixed
    )
    turns = burst.generate(params, 0)
    config = ReplayConfig(target=engine_url, trace=Path("burst.jsonl"), time_scale=TIME_SCALE)
    result = await replay(config, select_sessions(turns))
    assert [r.error for r in result.records] == [None] * 8
    by_group: dict[str, list[tuple[float, float]]] = {}
    for r in result.records:
        by_group.setdefault(r.session.rsplit("-", 1)[0], []).append(
            (r.start, r.start + r.latency_s)
        )
    for spans in by_group.values():
        # Every member was sent before any member of its group finished.
        assert max(start for start, _ in spans) < min(end for _, end in spans)
