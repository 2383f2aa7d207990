"""A workload in which each session names the API its client speaks: the trace field, the
generator's ``--api`` and a replay that sends each session through its own API."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest
from rich.console import Console

from bench.replay.report import print_run_report
from bench.replay.result import result_from_json, result_to_json
from bench.replay.runner import ReplayConfig, replay, select_sessions
from bench.workloads.api_bodies import PATHS, Api
from bench.workloads.trace import (
    TextBlock,
    TraceFormatError,
    Turn,
    group_sessions,
    read_trace,
    turn_from_json,
    turn_to_json,
    write_trace,
)
from tests.bench import test_replay_apis
from tests.bench.test_replay_apis import OUTPUT_TOKENS, TIME_SCALE
from tests.bench.test_workloads import _gen_parser
from tests.conftest import EngineFactory

# The fixture, by assignment: an imported name shadowed by a test's argument reads as a
# redefinition to the linter.
capturing_server = test_replay_apis.capturing_server

# Each session names its API but "gamma", which the run's default (chat) carries.
SESSION_APIS: dict[str, Api | None] = {"alpha": "responses", "beta": "messages", "gamma": None}


def _mixed_workload() -> list[Turn]:
    system = (TextBlock("shared-system", 120),)
    turns = []
    for index, (session, api) in enumerate(SESSION_APIS.items()):
        for turn in range(3):
            turns.append(
                Turn(
                    session=session,
                    turn=turn,
                    arrival=index * 0.5,
                    gap=0.0 if turn == 0 else 1.0,
                    user=(TextBlock(f"{session}-user-{turn}", 40 + 7 * turn),),
                    output_tokens=OUTPUT_TOKENS,
                    system=system if turn == 0 else None,
                    api=api if turn == 0 else None,
                )
            )
    return turns


def _expected_api(session: str) -> Api:
    return SESSION_APIS[session] or "chat"


# --- the trace field ----------------------------------------------------------------------


def test_the_api_round_trips_and_old_traces_have_none(tmp_path: Path) -> None:
    turns = _mixed_workload()
    path = tmp_path / "mixed.jsonl"
    write_trace(turns, path)
    assert read_trace(path) == turns
    lines = [turn_to_json(t) for t in turns]
    assert [line.get("api") for line in lines if line["turn"] == 0] == [
        "responses",
        "messages",
        None,
    ]
    assert all("api" not in line for line in lines if line["turn"] > 0)
    old = {"session": "s", "turn": 0, "user": "hi", "output_tokens": 4}
    assert turn_from_json(old).api is None
    assert turn_from_json({**old, "api": "messages"}).api == "messages"


def test_an_unknown_api_is_a_trace_format_error(tmp_path: Path) -> None:
    line = {"session": "s", "turn": 0, "user": "hi", "output_tokens": 4, "api": "grpc"}
    with pytest.raises(TraceFormatError, match="unknown api 'grpc'; known: chat, responses"):
        turn_from_json(line, "t.jsonl:1")
    path = tmp_path / "bad.jsonl"
    path.write_text('{"session": "s", "turn": 0, "user": "hi", "output_tokens": 4, "api": 3}\n')
    with pytest.raises(TraceFormatError, match=r"bad.jsonl:1.api: unknown api 3"):
        read_trace(path)


# --- the generator's --api ----------------------------------------------------------------


def _gen(tmp_path: Path, name: str, kind: str, seed: int, *extra: str) -> list[Turn]:
    out = tmp_path / f"{name}.jsonl"
    argv = ["gen", kind, "--seed", str(seed), "-o", str(out), "--sessions", "60", *extra]
    args = _gen_parser().parse_args(argv)
    assert args.func(args) == 0
    return read_trace(out)


def _turn0_apis(turns: list[Turn]) -> list[Api | None]:
    return [s.turns[0].api for s in group_sessions(turns)]


@pytest.mark.parametrize("kind", ["agent", "chat", "mix"])
def test_api_weights_draw_a_mix_deterministic_per_seed(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = "chat=1,responses=1,messages=2"
    plain = _gen(tmp_path, "plain", kind, 7)
    mixed = _gen(tmp_path, "mixed", kind, 7, "--api", weights)
    again = _gen(tmp_path, "again", kind, 7, "--api", weights)
    other = _gen(tmp_path, "other", kind, 8, "--api", weights)
    capsys.readouterr()
    assert mixed == again
    # The draws leave every other field as the same seed gives without --api.
    assert [dataclasses.replace(t, api=None) for t in mixed] == plain
    assert all(t.api is None for t in plain)
    assert all(t.api is None for t in mixed if t.turn > 0)
    apis = _turn0_apis(mixed)
    assert set(apis) == {"chat", "responses", "messages"}
    assert apis.count("messages") > apis.count("chat")  # weight 2 against 1, 60 sessions
    assert _turn0_apis(other) != apis


def test_one_api_names_every_session(tmp_path: Path) -> None:
    turns = _gen(tmp_path, "one", "chat", 3, "--api", "messages")
    assert set(_turn0_apis(turns)) == {"messages"}


@pytest.mark.parametrize("flag", ["grpc", "chat=1,grpc=1", "chat=x", "chat=-1", "chat=0"])
def test_a_bad_api_flag_is_refused(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _gen_parser().parse_args(["gen", "chat", "-o", str(tmp_path / "x"), "--api", flag])
    assert "--api" in capsys.readouterr().err


# --- the replay ---------------------------------------------------------------------------


async def test_each_session_is_posted_to_its_own_apis_path(
    capturing_server: tuple[str, list[tuple[str, str, object]]],
) -> None:
    url, seen = capturing_server
    config = ReplayConfig(target=url, trace=Path("mixed.jsonl"), model="m", time_scale=50.0)
    result = await replay(config, select_sessions(_mixed_workload()))
    assert len(seen) == 9  # every turn fails (HTTP 500) and the sessions go on
    for path, session, _ in seen:
        assert path == PATHS[_expected_api(session)], (path, session)
    assert all(r.api == _expected_api(r.session) for r in result.records)


async def test_a_mixed_trace_replays_through_each_api_onto_one_engine(
    engine_factory: EngineFactory,
) -> None:
    async with engine_factory(time_scale=TIME_SCALE) as running:
        config = ReplayConfig(
            target=running.url,
            trace=Path("mixed.jsonl"),
            concurrency=4,
            time_scale=TIME_SCALE,
        )
        result = await replay(config, select_sessions(_mixed_workload()))
    assert result.meta.api == "chat"  # the default, for "gamma"
    assert len(result.records) == 9
    for record in result.records:
        # Each API's stream reader reads only its own API's stream: a request sent to
        # another path would not have ended well.
        assert record.api == _expected_api(record.session), record
        assert record.error is None and record.status == 200, record
        assert record.completion_tokens == OUTPUT_TOKENS
        if record.turn > 0:
            assert record.cached_tokens > 0, record
            assert record.cached_tokens == record.oracle_cached_tokens, record

    # The records keep their API through the result file; older records read as meta.api.
    obj = result_to_json(result)
    assert result_from_json(obj).records == result.records
    by_api = {s["api"]: s for s in obj["summary"]["by_api"]}
    assert sorted(by_api) == ["chat", "messages", "responses"]
    assert all(s["requests"] == 3 and s["errors"] == 0 for s in by_api.values())
    assert all(s["hit_rate"] > 0 and s["ttft_p50"] > 0 for s in by_api.values())
    for record in obj["records"]:
        del record["api"]
    assert {r.api for r in result_from_json(obj).records} == {"chat"}

    out = io.StringIO()
    print_run_report(result, Console(file=out, width=200))
    report = out.getvalue()
    assert "default api=chat" in report
    assert "by client API" in report
    assert all(api in report for api in ("responses", "messages"))
