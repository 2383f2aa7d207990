"""The AgentX (Weka layout) reader, on traces written here in the format aiperf reads,
and the trace format's ``parent`` and ``ended_by`` fields."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.compare.demo import DemoConfig
from bench.compare.matrix import rows as matrix_rows
from bench.workloads import agentx
from bench.workloads.agentx_format import AgentxRequest, read_traces
from bench.workloads.sampling import poisson_arrivals
from bench.workloads.trace import (
    Session,
    TextBlock,
    TraceFormatError,
    Turn,
    group_sessions,
    read_trace,
    render_text,
    turn_from_json,
    write_trace,
)

BLOCK = 4  # tokens a hash id in the traces below


def _call(t: float, tokens: int, out: int, ids: list[int], **more: Any) -> dict[str, Any]:
    call = {"type": "n", "t": t, "model": "claude", "in": tokens, "out": out, "hash_ids": ids}
    return call | more


# One Claude Code session: the main agent (tools + system = 2 blocks) makes three calls
# that extend each other, a title generation that shares nothing, and, after a
# compaction, a call that keeps only the first two blocks; a subagent (1 declared
# block) starts from the main agent's first two blocks, its second call timed from its
# spawn as older captures do.
TRACE: dict[str, Any] = {
    "id": "tr1",
    "models": ["claude"],
    "block_size": BLOCK,
    "hash_id_scope": "local",
    "tool_tokens": 5,
    "system_tokens": 3,
    "requests": [
        _call(0.0, 14, 5, [1, 2, 3], stop="tool_use", api_time=2.0),
        _call(0.5, 8, 3, [50, 51], stop="end_turn", api_time=0.2),
        _call(3.0, 25, 3, [1, 2, 3, 4, 5, 6], input_types=["tool_result"], api_time=1.0),
        {
            "type": "subagent",
            "t": 4.0,
            "agent_id": "agent_001",
            "subagent_type": "Explore",
            "status": "completed",
            "duration_ms": 3000,
            "models": ["claude"],
            "tool_tokens": 4,
            "system_tokens": 0,
            "requests": [
                _call(5.0, 12, 2, [1, 2, 9], stop="end_turn", api_time=0.5),
                _call(2.0, 20, 1, [1, 2, 9, 10, 11], input_types=["text"]),
            ],
        },
        _call(10.0, 40, 4, [1, 2, 3, 4, 5, 6, 7, 8, 12], input_types=["text"], api_time=3.0),
        _call(20.0, 16, 2, [1, 2, 30, 31]),
    ],
}
MAIN = "agentx-tr1"


def _write(path: Path, trace: dict[str, Any]) -> Path:
    path.write_bytes(orjson.dumps(trace))
    return path


def _sessions(turns: list[Turn]) -> dict[str, Session]:
    return {s.id: s for s in group_sessions(turns)}


def _load(tmp_path: Path, **params: Any) -> dict[str, Session]:
    path = _write(tmp_path / "tr1.json", TRACE)
    return _sessions(agentx.load(path, agentx.AgentxParams(**params)))


def test_a_trace_becomes_the_main_agent_its_other_chains_and_its_subagent(
    tmp_path: Path,
) -> None:
    sessions = _load(tmp_path)
    assert sorted(sessions) == [MAIN, f"{MAIN}/agent_001", f"{MAIN}~1", f"{MAIN}~2"]
    assert [len(sessions[s].turns) for s in sorted(sessions)] == [3, 2, 1, 1]
    # In order of first call: the title generation at 0.5 s, the compaction at 20 s.
    assert sessions[f"{MAIN}~1"].turns[0].output_tokens == 3
    assert sessions[f"{MAIN}~2"].turns[0].arrival == 20.0
    parents = {sid: s.turns[0].parent for sid, s in sessions.items()}
    assert parents == {MAIN: None, f"{MAIN}~1": None, f"{MAIN}~2": None, f"{MAIN}/agent_001": MAIN}


def test_turn_0_is_the_hashed_prompt_with_the_declared_system_blocks(tmp_path: Path) -> None:
    sessions = _load(tmp_path)
    main = sessions[MAIN].turns[0]
    # tool + system = 8 tokens: 2 blocks of system; 14 tokens = 3 blocks and 2 fresh.
    assert main.system == (TextBlock(f"{MAIN}-1", BLOCK), TextBlock(f"{MAIN}-2", BLOCK))
    assert main.user == (TextBlock(f"{MAIN}-3", BLOCK), TextBlock(f"{MAIN}/t0", 2))
    sub = sessions[f"{MAIN}/agent_001"].turns[0]
    assert sub.system == (TextBlock(f"{MAIN}-1", BLOCK),)
    assert sub.user == (TextBlock(f"{MAIN}-2", BLOCK), TextBlock(f"{MAIN}-9", BLOCK))
    # Rendered, the subagent's prompt starts with the main agent's first two blocks.
    main_text = render_text(main.system or "") + render_text(main.user)
    sub_text = render_text(sub.system or "") + render_text(sub.user)
    two_blocks = 2 * BLOCK * 4  # bench.textgen's words are 4 characters a token
    assert sub_text[:two_blocks] == main_text[:two_blocks]
    assert sub_text[: two_blocks + BLOCK * 4] != main_text[: two_blocks + BLOCK * 4]


def test_later_turns_are_the_growth_their_gaps_the_idle_time(tmp_path: Path) -> None:
    turns = _load(tmp_path)[MAIN].turns
    # 25 - 14 - 5 (the reply the replay regenerates); then 40 - (14 + 5 + 6) - 3.
    assert [t.user for t in turns[1:]] == [
        (TextBlock(f"{MAIN}/t1", 6),),
        (TextBlock(f"{MAIN}/t2", 12),),
    ]
    # Start minus the previous start and its api_time: 3 - 0 - 2, 10 - 3 - 1.
    assert [t.gap for t in turns] == [0.0, 1.0, 6.0]
    assert [t.arrival for t in turns] == [0.0, 3.0, 10.0]
    assert [t.output_tokens for t in turns] == [5, 3, 4]
    sub = _load(tmp_path)[f"{MAIN}/agent_001"].turns
    assert [t.arrival for t in sub] == [5.0, 6.0]  # 2.0 after the spawn at 4.0
    assert sub[1].gap == 0.5


def test_max_gap_caps_the_pauses(tmp_path: Path) -> None:
    turns = _load(tmp_path, max_gap=2.0)[MAIN].turns
    assert [t.gap for t in turns] == [0.0, 1.0, 2.0]


def test_ended_by_from_stop_or_from_the_next_calls_input(tmp_path: Path) -> None:
    sessions = _load(tmp_path)
    # tool_use; no stop, but the next call's input is text; no stop and no next call.
    assert [t.ended_by for t in sessions[MAIN].turns] == ["tool", "user", None]
    assert [t.ended_by for t in sessions[f"{MAIN}/agent_001"].turns] == ["user", None]
    assert sessions[f"{MAIN}~1"].turns[0].ended_by == "user"
    assert sessions[f"{MAIN}~2"].turns[0].ended_by is None


def test_traces_start_as_a_poisson_process_and_keep_their_own_ids(tmp_path: Path) -> None:
    second = copy.deepcopy(TRACE) | {"id": "tr2"}
    path = tmp_path / "traces.jsonl"
    path.write_bytes(orjson.dumps(TRACE) + b"\n" + orjson.dumps(second) + b"\n")
    sessions = _sessions(agentx.load(path, agentx.AgentxParams(rate=0.1), seed=4))
    start = poisson_arrivals(4, agentx.KIND, 0.1, 2)[1]
    assert start > 0
    assert sessions["agentx-tr2"].turns[0].arrival == start
    assert sessions["agentx-tr2/agent_001"].turns[0].arrival == start + 5.0
    # Local hash ids: the same id in another trace is other text.
    first = sessions[MAIN].turns[0].system
    assert first is not None and first[0] == TextBlock(f"{MAIN}-1", BLOCK)
    other = sessions["agentx-tr2"].turns[0].system
    assert other is not None and other[0] == TextBlock("agentx-tr2-1", BLOCK)
    assert agentx.load(path, agentx.AgentxParams(max_traces=1)) == agentx.load(
        _write(tmp_path / "one.json", TRACE)
    )


def test_global_scope_keys_blocks_across_traces(tmp_path: Path) -> None:
    path = _write(tmp_path / "g.json", TRACE | {"hash_id_scope": "global"})
    system = _sessions(agentx.load(path))[MAIN].turns[0].system
    assert system == (TextBlock("agentx-1", BLOCK), TextBlock("agentx-2", BLOCK))


def test_a_directory_of_traces_reads_in_name_order(tmp_path: Path) -> None:
    _write(tmp_path / "b.json", copy.deepcopy(TRACE) | {"id": "b"})
    _write(tmp_path / "a.json", copy.deepcopy(TRACE) | {"id": "a"})
    assert [t.id for t in read_traces(tmp_path)] == ["a", "b"]


def test_max_context_cuts_sessions_and_leaves_out_those_too_long_to_start(
    tmp_path: Path,
) -> None:
    turns = {sid: len(s.turns) for sid, s in _load(tmp_path, max_context_tokens=20).items()}
    # Main: 14 + 5, then + 6 + 3 = 28; the subagent: 12 + 2, then + 6 + 1 = 21.
    assert turns == {MAIN: 1, f"{MAIN}/agent_001": 1, f"{MAIN}~1": 1, f"{MAIN}~2": 1}
    turns = {sid: len(s.turns) for sid, s in _load(tmp_path, max_context_tokens=15).items()}
    # The main agent's 14 + 5 and the compacted 16 + 2 do not fit at all.
    assert turns == {f"{MAIN}/agent_001": 1, f"{MAIN}~1": 1}


def _request(t: float, tokens: int, ids: list[int]) -> AgentxRequest:
    return AgentxRequest(t, tokens, 1, tuple(ids), "", None, ())


def test_chains_follow_the_longest_extension() -> None:
    calls = [
        _request(0, 100, [1, 2, 3]),
        _request(1, 120, [1, 2, 3, 4, 5]),  # extends 0
        _request(2, 50, []),  # no evidence: rides the first chain
        _request(3, 130, [1, 2, 3, 8, 9]),  # shares 3 of 1's 5 blocks: a chain of its own
        _request(4, 200, [1, 2, 3, 4, 5, 6]),  # extends 1, not the fork
        _request(5, 140, [1, 2, 3, 8, 9, 10]),  # extends the fork
        _request(6, 0, [1]),  # nothing to send
        _request(7, 145, [1, 2, 3, 8, 9, 7]),  # 5's partial last block changed: extends it
        _request(8, 300, [1, 2, 3, 4, 5, 6, 11]),
        _request(9, 10, [1, 2]),  # too short to extend anything
        _request(10, 400, [1, 2, 3, 8, 9, 7, 12]),  # extends 9 by 2 and 7 by 6: the longer
        _request(11, 10, [1, 2]),  # 9 again, no longer: a regeneration
    ]
    assert agentx.link_chains(calls) == [[0, 1, 2, 4, 8], [3, 5, 7, 10], [9], [11]]
    assert agentx.link_chains([_request(0, 10, []), _request(1, 20, [1, 2])]) == [[0, 1]]


def test_a_chain_extended_as_far_as_another_goes_to_the_more_recent_one() -> None:
    again = [_request(0, 100, [1, 2, 3]), _request(1, 100, [1, 2, 3])]  # a regeneration
    assert agentx.link_chains([*again, _request(2, 150, [1, 2, 3, 4, 5])]) == [[0], [1, 2]]
    shorter_later = [_request(0, 100, [1, 2, 3]), _request(1, 50, [1, 2])]
    longer = _request(2, 200, [1, 2, 3, 4])
    assert agentx.link_chains([*shorter_later, longer]) == [[0, 2], [1]]


def test_repeated_agent_ids_get_numbered_sessions(tmp_path: Path) -> None:
    trace = copy.deepcopy(TRACE)
    trace["requests"].append(copy.deepcopy(trace["requests"][3]))
    sessions = _sessions(agentx.load(_write(tmp_path / "t.json", trace)))
    assert f"{MAIN}/agent_001#2" in sessions


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_size": 0}, "block_size"),
        ({"hash_id_scope": "planet"}, "hash_id_scope"),
        ({"requests": [{"type": "x", "t": 0}]}, "type 'n' or 's'"),
        ({"requests": [{"type": "n", "t": 0, "out": 1}]}, "'in'"),
        ({"requests": [_call(0, -1, 1, [])]}, "non-negative"),
        ({"requests": [_call(0, 4, 1, []) | {"hash_ids": ["a"]}]}, "hash_ids"),
        ({"requests": [{"type": "subagent", "t": 0, "agent_id": "a"}]}, "requests"),
    ],
)
def test_malformed_traces_are_refused(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    path = _write(tmp_path / "bad.json", TRACE | change)
    with pytest.raises(TraceFormatError, match=message):
        agentx.load(path)


def test_parent_and_ended_by_round_trip_through_the_trace_format(tmp_path: Path) -> None:
    turns = agentx.load(_write(tmp_path / "tr1.json", TRACE))
    path = tmp_path / "trace.jsonl"
    write_trace(turns, path)
    assert read_trace(path) == turns
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert {line.get("parent") for line in lines} == {None, MAIN}
    assert {line.get("ended_by") for line in lines} == {None, "tool", "user"}


def test_the_trace_format_refuses_unknown_endings_and_empty_parents() -> None:
    line = {"session": "s", "turn": 0, "user": "hi", "output_tokens": 1}
    assert turn_from_json(line).parent is None
    with pytest.raises(TraceFormatError, match="ended_by"):
        turn_from_json(line | {"ended_by": "timeout"})
    with pytest.raises(TraceFormatError, match="parent"):
        turn_from_json(line | {"parent": ""})


def test_the_matrix_has_an_agentx_row_only_for_a_given_trace(tmp_path: Path) -> None:
    path = _write(tmp_path / "tr1.json", TRACE)
    assert "agentx" not in {r.name for r in matrix_rows()}
    row = {r.name: r for r in matrix_rows(agentx_source=path)}["agentx"]
    turns = row.workload(DemoConfig(seed=2))
    assert {t.session for t in turns} == set(_load(tmp_path))
