"""``kvrouter bench rescore``: a finished matrix's figures rebuilt from its saved runs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from bench.compare.rescore import rescore
from bench.replay.reference import ReferenceParams, capacity_reference
from bench.replay.result import RunMeta, RunResult, save_result
from bench.workloads.trace import write_trace
from tests.bench.test_reference import _agent_trace, _records


def test_rescore_rebuilds_the_reference_from_each_rounds_trace_and_records(
    tmp_path: Path,
) -> None:
    turns = _agent_trace()
    records = _records(turns)
    row = tmp_path / "chat"  # a row whose workload is a lambda: rows are found by name
    row.mkdir()
    write_trace(turns, row / "trace.r1.jsonl")
    meta = RunMeta(
        target="http://x",
        trace="t",
        model="m",
        time_scale=1.0,
        concurrency=0,
        started_at="2026-12-01T00:00:00Z",
        duration_s=100.0,
    )
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
