"""``bench.aiperf`` without aiperf: its export read as aiperf 0.13 writes it, the dataset
it is given, and the router's counters turned into a round's hit rate."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from rich.console import Console

from bench.aiperf.export import TtftPercentiles, read_ttft, record
from bench.aiperf.report import RoundFigures, RouterCounts, rounds_table
from bench.aiperf.sessions import SessionShape, write_sessions
from bench.soak.sample import Series

# Fields of one line of aiperf 0.13's profile_export.jsonl (a streamed chat request).
LINE: dict[str, Any] = {
    "metadata": {
        "session_num": 0,
        "x_correlation_id": "e2293a38-1e03-4dc9-927f-b4baa71649b4",
        "conversation_id": "session-0",
        "turn_index": 1,
        "benchmark_phase": "profiling",
    },
    "metrics": {
        "time_to_first_token": {"value": 55.945316, "unit": "ms"},
        "usage_prompt_tokens": {"value": 1222, "unit": "tokens"},
        "usage_prompt_cache_read_tokens": {"value": 1024, "unit": "tokens"},
        "output_sequence_length": {"value": 64, "unit": "tokens"},
    },
}


def test_a_request_as_aiperf_exported_it() -> None:
    got = record(LINE)
    assert (got.conversation, got.turn, got.correlation_id) == (
        "session-0",
        1,
        "e2293a38-1e03-4dc9-927f-b4baa71649b4",
    )
    assert (got.ttft_ms, got.prompt_tokens, got.cached_tokens, got.error) == (
        55.945316,
        1222,
        1024,
        None,
    )


def test_a_failed_request_has_its_error_and_no_ttft() -> None:
    failed = {**LINE, "metrics": {}, "error": {"code": 503, "type": "HTTP", "message": "busy"}}
    got = record(failed)
    assert (got.ttft_ms, got.prompt_tokens, got.error) == (None, None, "busy")


def test_a_ttft_in_another_unit_is_refused(tmp_path: Path) -> None:
    seconds = {"value": 0.05, "unit": "s"}
    with pytest.raises(ValueError, match="not ms"):
        record({**LINE, "metrics": {"time_to_first_token": seconds}})
    (tmp_path / "profile_export_aiperf.json").write_bytes(
        orjson.dumps({"time_to_first_token": {**seconds, "p50": 1, "p90": 1, "p99": 1}})
    )
    with pytest.raises(ValueError, match="not ms"):
        read_ttft(tmp_path)


def test_the_summary_percentiles(tmp_path: Path) -> None:
    ttft = {"unit": "ms", "avg": 15.6, "p50": 12.1, "p90": 28.5, "p99": 48.7, "count": 9}
    (tmp_path / "profile_export_aiperf.json").write_bytes(
        orjson.dumps({"time_to_first_token": ttft, "request_count": {"avg": 9}})
    )
    got = read_ttft(tmp_path)
    assert (got.p50_ms, got.p90_ms, got.p99_ms, got.count) == (12.1, 28.5, 48.7, 9)


def lines_of(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_sessions_in_aiperfs_multi_turn_format(tmp_path: Path) -> None:
    shape = SessionShape(sessions=2, turns=3, system_tokens=50, user_tokens=20, output_tokens=8)
    lines = lines_of(write_sessions(shape, tmp_path / "s.jsonl"))
    assert [line["session_id"] for line in lines] == ["session-0", "session-1"]
    for line in lines:
        system, *turns = line["turns"]
        assert system["role"] == "system" and len(system["text"]) == 4 * 50
        assert [t["output_length"] for t in turns] == [8, 8, 8]
        assert all(len(t["text"]) == 4 * 20 and "role" not in t for t in turns)
    # Every text its own (no prefix shared between sessions), and another key's too.
    texts = [t["text"] for line in lines for t in line["turns"]]
    another = lines_of(write_sessions(replace(shape, key="other"), tmp_path / "o.jsonl"))
    texts += [t["text"] for line in another for t in line["turns"]]
    assert len(set(texts)) == len(texts)


def series(cached: float, prompted: float, keyed: float) -> Series:
    return [
        ("kvrouter_engine_cached_tokens_total", {"worker": "w0"}, cached / 2),
        ("kvrouter_engine_cached_tokens_total", {"worker": "w1"}, cached / 2),
        ("kvrouter_usage_prompt_tokens_total", {"worker": "w0"}, prompted),
        ("kvrouter_session_keys_total", {"source": "header:x-session-affinity"}, keyed),
        ("kvrouter_session_keys_total", {"source": "none"}, 5.0),
    ]


def test_a_rounds_hit_rate_is_what_the_router_counted_during_it() -> None:
    counts = RouterCounts.between(series(100, 1000, 3), series(400, 1600, 15))
    assert counts == RouterCounts(300, 600, 12)
    assert counts.hit_rate == 0.5


def test_a_router_without_the_counters_has_no_hit_rate() -> None:
    elsewhere: Series = [("process_cpu_seconds_total", {}, 3.0)]
    assert RouterCounts.between(elsewhere, elsewhere) == RouterCounts(None, None, None)
    assert RouterCounts.between(None, None).hit_rate is None
    assert RouterCounts.between(series(0, 0, 0), series(0, 0, 0)).hit_rate is None


def test_the_table_has_each_round_and_the_median_with_its_range() -> None:
    rounds = [
        RoundFigures(n, 12, 0, TtftPercentiles(p50, 2 * p50, 3 * p50, 12), RouterCounts(h, 100, 12))
        for n, p50, h in ((1, 10.0, 60), (2, 30.0, 40), (3, 20.0, 50))
    ]
    console = Console(width=200, record=True)
    console.print(rounds_table(rounds, "t"))
    text = console.export_text()
    p50_row = next(line for line in text.splitlines() if "TTFT p50" in line)
    cells = [cell.strip() for cell in p50_row.split("│")[2:6]]
    assert cells == ["10.0", "30.0", "20.0", "20.0 (10.0-30.0)"]
    hit_row = next(line for line in text.splitlines() if "hit rate" in line)
    assert "50.0% (40.0%-60.0%)" in hit_row
