"""Workload generators and trace loaders: shapes, determinism, file formats and the CLI."""

from __future__ import annotations

import argparse
import importlib
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.workloads import agent, azure, burst, chat, mix, mooncake, qa, shared_prompt
from bench.workloads import cli as workloads_cli
from bench.workloads.sampling import LogNormal
from bench.workloads.stats import context_before, summarize
from bench.workloads.trace import (
    TextBlock,
    TraceFormatError,
    Turn,
    group_sessions,
    read_trace,
    render_text,
    text_tokens,
    turn_to_json,
    write_trace,
)

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
CONVERSATION = TRACES / "mooncake_fast25" / "conversation_trace.jsonl"
AIPERF_AGENTIC_SAMPLE = Path(__file__).parent / "data" / "aiperf_agentic" / "dataset.jsonl"


def _agent(seed: int) -> list[Turn]:
    return agent.generate(agent.AgentParams(sessions=300), seed)


def _chat(seed: int) -> list[Turn]:
    return chat.generate(chat.ChatParams(sessions=200), seed)


def _shared(seed: int) -> list[Turn]:
    return shared_prompt.generate(shared_prompt.SharedPromptParams(sessions=300), seed)


def _mix(seed: int) -> list[Turn]:
    return mix.generate(mix.MixParams(sessions=120), seed)


def _qa(seed: int) -> list[Turn]:
    return qa.generate(qa.QaParams(), seed)


def _burst(seed: int) -> list[Turn]:
    return burst.generate(burst.BurstParams(groups=40), seed)


GENERATED: dict[str, Callable[[int], list[Turn]]] = {
    "agent": _agent,
    "chat": _chat,
    "shared-prompt": _shared,
    "mix": _mix,
    "qa": _qa,
    "burst": _burst,
}


def _later_users(turns: Sequence[Turn]) -> list[int]:
    return [text_tokens(t.user) for t in turns if t.turn > 0]


def _system_keys(turns: Sequence[Turn]) -> Counter[str]:
    keys: Counter[str] = Counter()
    for t in turns:
        if t.system is not None:
            assert not isinstance(t.system, str)
            keys.update(block.key for block in t.system)
    return keys


# --- generators ---------------------------------------------------------------------


def test_agent_matches_published_shape() -> None:
    turns = _agent(0)
    stats = summarize(turns)
    assert stats.sessions == 300
    assert 33 * 0.8 <= stats.median_turns <= 33 * 1.2
    assert stats.median_context_at_turn_30 is not None
    assert 80_000 * 0.75 <= stats.median_context_at_turn_30 <= 80_000 * 1.25
    assert stats.sessions_reaching_turn_30 >= 100
    added = _later_users(turns)
    assert sum(100 <= n <= 5000 for n in added) / len(added) >= 0.8
    outputs = [t.output_tokens for t in turns]
    assert min(outputs) >= 50 and max(outputs) <= 1500
    assert 200 <= statistics.median(outputs) <= 300
    assert 3.0 <= statistics.median(t.gap for t in turns if t.turn > 0) <= 5.0
    first_users = [text_tokens(t.user) for t in turns if t.turn == 0]
    assert min(first_users) >= 500 and max(first_users) <= 3000


def test_agent_sessions_share_few_system_prompts_and_respect_the_context_limit() -> None:
    params = agent.AgentParams(sessions=300)
    turns = agent.generate(params, 1)
    keys = _system_keys(turns)
    assert set(keys) <= {f"agent-sys-{i}" for i in range(len(params.system_prompts))}
    assert min(keys.values()) >= 30  # every prompt is shared by many sessions
    for session in group_sessions(turns):
        assert 1 <= len(session.turns) <= 120
        assert context_before(session, len(session.turns)) <= params.max_context_tokens
        assert 2000 <= text_tokens(session.turns[0].system or "") <= 6000


def test_chat_sessions_are_short() -> None:
    turns = _chat(0)
    for session in group_sessions(turns):
        assert 2 <= len(session.turns) <= 8
    users = [text_tokens(t.user) for t in turns]
    assert min(users) >= 20 and max(users) <= 500
    assert all(100 <= t.output_tokens <= 800 for t in turns)
    assert all(5.0 <= t.gap <= 30.0 for t in turns if t.turn > 0)
    assert all(text_tokens(t.system) <= 500 for t in turns if t.system is not None)


def test_shared_prompt_sessions_share_a_few_long_prompts_by_popularity() -> None:
    turns = _shared(0)
    sessions = group_sessions(turns)
    assert all(1 <= len(s.turns) <= 4 for s in sessions)
    keys = _system_keys(turns)
    assert len(keys) == 4
    ranked = [keys[f"shared-sys-{i}"] for i in range(4)]
    assert ranked[0] > ranked[-1]  # Zipf: the first prompt is the most popular
    assert min(ranked) >= 20
    sizes = {text_tokens(t.system) for t in turns if t.system is not None}
    assert min(sizes) >= 2000 and max(sizes) <= 8192


def test_mix_holds_every_kind_with_unique_prefixed_ids() -> None:
    turns = _mix(0)
    sessions = group_sessions(turns)
    assert len(sessions) == 120
    kinds = Counter(s.id.rsplit("-", 1)[0] for s in sessions)
    assert set(kinds) == {"agent", "chat", "shared-prompt"}
    assert kinds["chat"] > kinds["agent"]  # default weights 1:2:1
    pure = {s.id: s for s in group_sessions(chat.generate(chat.ChatParams(sessions=200), 0))}
    for s in sessions:
        if s.id.startswith("chat-"):  # the mix reuses the pure generator's sessions, retimed
            assert [t.user for t in s.turns] == [t.user for t in pure[s.id].turns]
            assert [t.gap for t in s.turns] == [t.gap for t in pure[s.id].turns]


@pytest.mark.parametrize("kind", sorted(GENERATED))
def test_generators_are_deterministic(kind: str) -> None:
    generate = GENERATED[kind]
    assert generate(3) == generate(3)
    assert generate(3) != generate(4)


@pytest.mark.parametrize("kind", sorted(GENERATED))
def test_generated_traces_round_trip(kind: str, tmp_path: Path) -> None:
    turns = GENERATED[kind](0)
    path = tmp_path / "trace.jsonl"
    assert write_trace(turns, path) == len(turns)
    back = read_trace(path)
    assert [turn_to_json(t) for t in back] == [turn_to_json(t) for t in turns]
    assert [(t.user, t.system, t.output_tokens) for t in back] == [
        (t.user, t.system, t.output_tokens) for t in turns
    ]


def test_more_sessions_append_and_keep_earlier_ones() -> None:
    few = chat.generate(chat.ChatParams(sessions=5), 7)
    many = chat.generate(chat.ChatParams(sessions=10), 7)
    assert many[: len(few)] == few


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="median"):
        LogNormal(median=10, sigma=1, low=20, high=30)
    with pytest.raises(ValueError, match="turns"):
        chat.ChatParams(min_turns=5, max_turns=2)
    with pytest.raises(ValueError, match="rate"):
        agent.AgentParams(rate=0)
    with pytest.raises(ValueError, match="unknown kind"):
        mix.MixParams(weights=(("agent", 1.0), ("nope", 1.0)))


# --- Mooncake -----------------------------------------------------------------------


def _mooncake_row(ms: int, length: int, output: int, ids: list[int]) -> dict[str, Any]:
    return {"timestamp": ms, "input_length": length, "output_length": output, "hash_ids": ids}


# Chains: row 2 extends row 0 (its partial last block 2 became 4); row 3 re-sends row 2's
# prompt (a regeneration: new session); row 4 extends rows 2 and 3 and follows the more
# recent one; row 6 extends row 5 whose last block is full; row 7 shares only the
# common block 0 with row 1, which is not enough.
MOONCAKE_SAMPLE = [
    _mooncake_row(0, 1200, 100, [0, 1, 2]),
    _mooncake_row(5000, 1600, 80, [0, 1, 4, 5]),
    _mooncake_row(1000, 700, 50, [0, 3]),  # out of order in the file on purpose
    _mooncake_row(6000, 1600, 90, [0, 1, 4, 5]),
    _mooncake_row(9000, 2080, 70, [0, 1, 4, 6, 7]),
    _mooncake_row(10000, 1024, 10, [0, 8]),
    _mooncake_row(12000, 1234, 60, [0, 8, 9]),
    _mooncake_row(13000, 1100, 40, [0, 10, 11]),
]


def _write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return path


def test_mooncake_rows_link_into_sessions(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "mc.jsonl", MOONCAKE_SAMPLE)
    rows = mooncake.read_rows(path)
    assert [r.timestamp_ms for r in rows] == sorted(r.timestamp_ms for r in rows)
    linking = mooncake.link_sessions(rows, mooncake.MooncakeParams())
    # Indices are in timestamp order: 0:0 ms, 1:1000, 2:5000, 3:6000, 4:9000, ...
    assert linking.sessions == ((0, 2), (1,), (3, 4), (5, 6), (7,))
    assert linking.multi_turn == 3
    assert linking.forks == 1


def test_mooncake_turns_carry_blocks_lengths_and_timing(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "mc.jsonl", MOONCAKE_SAMPLE)
    sessions = {s.id: s for s in group_sessions(mooncake.load(path))}
    first = sessions["mooncake-0"].turns
    assert first[0].user == (TextBlock("mc-0", 512), TextBlock("mc-1", 512), TextBlock("mc-2", 176))
    assert first[0].arrival == 0.0 and first[0].output_tokens == 100
    # 1600 - 1200 tokens added, of which the previous reply is 100.
    assert first[1].user == (TextBlock("mooncake-0/t1", 300),)
    assert first[1].gap == 5.0 and first[1].arrival == 5.0
    regenerated = sessions["mooncake-3"].turns
    assert text_tokens(regenerated[0].user) == 1600
    assert regenerated[1].user == (TextBlock("mooncake-3/t1", 2080 - 1600 - 90),)
    assert regenerated[1].gap == 3.0
    # Equal block ids give equal text, so the sessions share a 1024-token prefix.
    shared = render_text(first[0].user)[: 1024 * 4]
    assert render_text(regenerated[0].user).startswith(shared)
    assert render_text(regenerated[0].user)[: 1025 * 4] != render_text(first[0].user)[: 1025 * 4]


def test_mooncake_rejects_inconsistent_rows(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [_mooncake_row(0, 2000, 10, [0, 1])])
    with pytest.raises(TraceFormatError, match="hash_ids"):
        mooncake.read_rows(path)


@pytest.mark.skipif(not CONVERSATION.exists(), reason="shared Mooncake trace not present")
def test_mooncake_conversation_trace() -> None:
    rows = mooncake.read_rows(CONVERSATION)
    params = mooncake.MooncakeParams()
    linking = mooncake.link_sessions(rows, params)
    assert len(rows) == 12031
    assert (len(linking.sessions), linking.multi_turn, linking.forks) == (8199, 2008, 171)
    assert max(len(s) for s in linking.sessions) == 43
    turns = mooncake.to_turns(rows, linking, params)
    # Replayed prompts have the trace's lengths except where the trace grew by less than
    # the previous reply plus the shortest user message.
    by_id = {s.id: s for s in group_sessions(turns)}
    exact = 0
    for indices in linking.sessions:
        session = by_id[f"mooncake-{indices[0]}"]
        for k, index in enumerate(indices):
            prompt = context_before(session, k) + text_tokens(session.turns[k].user)
            assert prompt >= rows[index].input_length
            exact += prompt == rows[index].input_length
    assert exact / len(rows) >= 0.95


# --- Azure --------------------------------------------------------------------------

AZURE_CSV = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:15:48.9300000,396,109\n"
    "2023-11-16 18:15:46.6805900,374,44\n"
    "2023-11-16 18:15:47.1805900,1200,0\n"
)


def _azure_csv(tmp_path: Path) -> Path:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE_CSV, encoding="utf-8")
    return path


def test_azure_arrivals_and_single_turn_sessions(tmp_path: Path) -> None:
    path = _azure_csv(tmp_path)
    assert azure.arrival_offsets(path) == pytest.approx([0.0, 0.5, 2.24941])
    turns = azure.single_turn_sessions(azure.read_rows(path))
    assert [text_tokens(t.user) for t in turns] == [374, 1200, 396]
    assert [t.output_tokens for t in turns] == [44, 1, 109]  # at least one token
    assert len({t.session for t in turns}) == 3


def test_with_arrivals_moves_whole_sessions(tmp_path: Path) -> None:
    arrivals = azure.arrival_offsets(_azure_csv(tmp_path))
    turns = chat.generate(chat.ChatParams(sessions=3), 0)
    retimed = azure.with_arrivals(turns, arrivals)
    before = {s.id: s for s in group_sessions(turns)}
    after = group_sessions(retimed)
    assert [s.arrival for s in after] == pytest.approx(arrivals)
    for s in after:
        old = before[s.id]
        assert [t.gap for t in s.turns] == [t.gap for t in old.turns]
        shift = s.arrival - old.arrival
        assert [t.arrival for t in s.turns] == pytest.approx([t.arrival + shift for t in old.turns])
    with pytest.raises(ValueError, match="arrival times"):
        azure.with_arrivals(chat.generate(chat.ChatParams(sessions=4), 0), arrivals)


def test_azure_rejects_a_wrong_header(tmp_path: Path) -> None:
    path = tmp_path / "wrong.csv"
    path.write_text("time,in,out\n1,2,3\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match="columns"):
        azure.read_rows(path)


# --- CLI ----------------------------------------------------------------------------


def _gen_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench")
    workloads_cli.register(parser.add_subparsers(dest="bench_command", required=True))
    return parser


def _agentx_trace(path: Path) -> Path:
    call = {"type": "n", "t": 0.0, "model": "m", "in": 300, "out": 20, "hash_ids": [1, 2]}
    trace = {"id": "t", "models": ["m"], "block_size": 64, "requests": [call]}
    path.write_bytes(orjson.dumps(trace))
    return path


def _kind_args(kind: str, tmp_path: Path) -> list[str]:
    sources = {
        "mooncake": ["--source", str(_write_jsonl(tmp_path / "mc.jsonl", MOONCAKE_SAMPLE))],
        "azure": ["--source", str(_azure_csv(tmp_path))],
        "aiperf-agentic": ["--source", str(AIPERF_AGENTIC_SAMPLE)],
        "agentx": ["--source", str(_agentx_trace(tmp_path / "agentx.json"))],
        "qa": ["--users", "6", "--rounds", "3"],
        "burst": ["--groups", "2", "--group-size", "3"],
    }
    return sources.get(kind, ["--sessions", "6", "--rate", "2"])


def _kind_parser(kind: str) -> argparse.ArgumentParser:
    """The parser of ``bench gen KIND``."""

    def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return dict(action.choices)

    return subparsers(subparsers(_gen_parser())["gen"])[kind]


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


# What cli.py adds: every kind's, and the generated kinds' population and arrivals.
COMMON_FLAGS = {"-h", "--help", "-o", "--output", "--seed", "--api"}
POPULATION_FLAGS = {"--sessions", "--rate", "--arrivals-from"}


@pytest.mark.parametrize("kind", sorted(workloads_cli.GENERATORS))
def test_each_kind_defines_its_flags_in_its_own_module(kind: str) -> None:
    module = importlib.import_module(f"bench.workloads.{kind.replace('-', '_')}")
    assert kind == module.KIND
    generator = workloads_cli.GENERATORS[kind]
    assert generator.add_arguments is module.add_arguments
    assert generator.build is module.from_args
    own = argparse.ArgumentParser(add_help=False)
    module.add_arguments(own)
    everything = _flags(_kind_parser(kind))
    assert _flags(own) <= everything
    added_by_cli = COMMON_FLAGS | (POPULATION_FLAGS if generator.synthetic else set())
    assert everything - _flags(own) == added_by_cli - _flags(own)


@pytest.mark.parametrize("kind", sorted(workloads_cli.GENERATORS))
def test_cli_writes_every_registered_kind(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "trace.jsonl"
    args = _gen_parser().parse_args(
        ["gen", kind, "--seed", "2", "-o", str(out), *_kind_args(kind, tmp_path)]
    )
    assert args.func(args) == 0
    turns = read_trace(out)
    assert turns
    printed = capsys.readouterr().out
    assert f"{len(group_sessions(turns))} sessions" in printed
    assert "median" in printed and "prompt tokens" in printed


def test_cli_kind_knobs_and_arrivals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "agent.jsonl"
    argv = [
        "gen",
        "agent",
        "-o",
        str(out),
        "--sessions",
        "3",
        "--turns-median",
        "6",
        "--system-prompts",
        "1000",
        "--arrivals-from",
        str(_azure_csv(tmp_path)),
    ]
    args = _gen_parser().parse_args(argv)
    assert args.func(args) == 0
    sessions = group_sessions(read_trace(out))
    assert [s.arrival for s in sessions] == pytest.approx([0.0, 0.5, 2.24941])
    assert all(text_tokens(s.turns[0].system or "") == 1000 for s in sessions)
    assert "3 sessions" in capsys.readouterr().out


def test_cli_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = _gen_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["gen", "nope", "-o", str(tmp_path / "x.jsonl")])
    err = capsys.readouterr().err
    assert "agent" in err and "mooncake" in err and "azure" in err
    with pytest.raises(ValueError, match="known: agent"):
        workloads_cli.build_trace("nope", argparse.Namespace())
    args = parser.parse_args(
        [
            "gen",
            "chat",
            "-o",
            str(tmp_path / "x.jsonl"),
            "--sessions",
            "4",
            "--arrivals-from",
            str(_azure_csv(tmp_path)),
        ]
    )
    assert args.func(args) == 2
    assert "arrival times" in capsys.readouterr().err


def test_kvrouter_bench_gen_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main

    out = tmp_path / "mix.jsonl"
    assert main(["bench", "gen", "mix", "--seed", "1", "--sessions", "8", "-o", str(out)]) == 0
    assert len(group_sessions(read_trace(out))) == 8
    assert "8 sessions" in capsys.readouterr().out
