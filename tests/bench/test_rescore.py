"""``kvrouter bench rescore``: a finished matrix's figures rebuilt from its saved runs."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from bench.compare.offered_load import loads_written
from bench.compare.rescore import register, rescore
from bench.replay.reference import ReferenceParams, capacity_reference
from bench.replay.result import RunMeta, RunResult, save_result
from bench.workloads.trace import write_trace
from tests.bench.test_reference import _agent_trace, _records


def _meta(duration_s: float, slo_ttft_s: float | None = None) -> RunMeta:
    return RunMeta(
        target="http://x",
        trace="t",
        model="m",
        time_scale=1.0,
        concurrency=0,
        started_at="2026-12-01T00:00:00Z",
        duration_s=duration_s,
        slo_ttft_s=slo_ttft_s,
    )


def test_rescore_rebuilds_the_reference_from_each_rounds_trace_and_records(
    tmp_path: Path,
) -> None:
    turns = _agent_trace()
    records = _records(turns)
    row = tmp_path / "chat"  # a row whose workload is a lambda: rows are found by name
    row.mkdir()
    write_trace(turns, row / "trace.r1.jsonl")
    meta = _meta(duration_s=100.0)
    # A slower router's run: the same requests, each session's turns bunched together.
    in_session_order = sorted(records, key=lambda r: (r.session, r.turn))
    bunched = [replace(r, start=float(i)) for i, r in enumerate(in_session_order)]
    save_result(RunResult(meta, tuple(records)), row / "fast.r1.json")
    save_result(RunResult(meta, tuple(bunched)), row / "slow.r1.json")
    (row / "rounds.json").write_bytes(orjson.dumps({"slow": {}, "fast": {}}))
    (tmp_path / "not-a-row").mkdir()

    results = rescore(tmp_path, engines=1, kv_tokens=4000)

    assert list(results) == ["chat"] and results["chat"].labels == ["slow", "fast"]
    params = ReferenceParams(1, 4000)
    for label, run_records in (("slow", bunched), ("fast", records)):
        (run,) = results["chat"].runs[label]
        expected = capacity_reference(turns, run_records, params)
        assert run.reference_hit_rate == pytest.approx(expected.hit_rate)
    slow, fast = (results["chat"].runs[label][0].reference_hit_rate for label in ("slow", "fast"))
    assert slow != pytest.approx(fast)  # each run's own order, from its own records
    saved = orjson.loads((tmp_path / "matrix.json").read_bytes())
    assert set(saved["chat"]) == {"slow", "fast"}
    assert "| chat | slow |" in (tmp_path / "matrix.md").read_text()


def test_rescore_reads_each_offered_load_against_another_objective_keeping_the_extras(
    tmp_path: Path,
) -> None:
    turns = _agent_trace()
    # First tokens 0.1 s, 0.2 s, ... : how many are within an objective is known.
    records = [replace(r, ttft_s=0.1 * (i + 1)) for i, r in enumerate(_records(turns))]
    meta = _meta(duration_s=10.0, slo_ttft_s=0.25)
    for load in ("0.5x", "2x"):
        directory = tmp_path / "chat" / f"load-{load}"
        directory.mkdir(parents=True)
        write_trace(turns, directory / "trace.r1.jsonl")
        save_result(RunResult(meta, tuple(records)), directory / "queue.r1.json")
        (directory / "rounds.json").write_bytes(orjson.dumps({"queue": {}}))
    extras = {"queue_sheds": 7.0, "queue_wait_p99": 2.5}
    (tmp_path / "chat/load-2x/queue.r1.extras.json").write_bytes(orjson.dumps(extras))
    into = tmp_path / "at-1s"

    results = rescore(tmp_path, engines=1, kv_tokens=4000, slo_ttft_s=1.0, into=into)

    assert list(results) == ["chat 0.5x", "chat 2x"]
    for name in results:
        (run,) = results[name].runs["queue"]
        assert run.summary.goodput_per_s == pytest.approx(10 / 10.0)  # 0.1 s ... 1.0 s
    assert results["chat 2x"].runs["queue"][0].extras == extras
    assert results["chat 0.5x"].runs["queue"][0].extras == {}
    assert "| chat 2x | queue |" in (into / "matrix.md").read_text()
    assert not (tmp_path / "matrix.md").exists()  # the matrix's own figures kept

    kept = rescore(tmp_path, engines=1, kv_tokens=4000)
    (run,) = kept["chat 2x"].runs["queue"]
    assert run.summary.goodput_per_s == pytest.approx(2 / 10.0)  # the runs' own 0.25 s


def test_only_the_load_directories_the_matrix_writes_are_read(tmp_path: Path) -> None:
    for name in ("load-0.5x", "load-2x", "load-1.0x", "load-nanx", "load-1_5x", "load-0x"):
        (tmp_path / name).mkdir()
    (tmp_path / "load-3x").write_text("a file, not a run")
    assert loads_written(tmp_path) == [(0.5, tmp_path / "load-0.5x"), (2.0, tmp_path / "load-2x")]


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--slo-ttft", "10"], "--slo-ttft needs --into"),
        (["--slo-ttft", "nan", "--into", "x"], "finite number of seconds > 0"),
        (["--slo-ttft", "0", "--into", "x"], "finite number of seconds > 0"),
        (["--slo-ttft", "ten", "--into", "x"], "not a number of seconds"),
    ],
)
def test_another_objective_is_a_positive_number_written_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], complaint: str
) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    try:
        args = parser.parse_args(["rescore", str(tmp_path), *argv])
        status = args.func(args)
    except SystemExit as exc:
        status = exc.code
    assert status == 2
    assert complaint in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written
