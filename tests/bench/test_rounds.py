"""Repeated runs reported as median and range (bench.replay.rounds), on plain values."""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson
import pytest
from rich.console import Console

from bench.compare.demo import add_workload_arguments, demo_config
from bench.replay.result import RequestRecord, RunMeta, RunResult, summarize
from bench.replay.rounds import (
    FIGURE_BY_KEY,
    Rounds,
    ScoredRun,
    Spread,
    print_rounds,
    rotated,
    show_spread,
)


def _run(cached: int, ttft: float, reference: float | None = 0.8) -> ScoredRun:
    records = [
        RequestRecord(
            session="s",
            turn=t,
            start=float(t),
            ttft_s=ttft,
            latency_s=1.0,
            prompt_tokens=100,
            cached_tokens=cached if t else 0,
            oracle_cached_tokens=90 if t else 0,
            completion_tokens=10,
            worker=None,
            error=None,
            status=200,
        )
        for t in range(4)
    ]
    return ScoredRun(summarize(records, 10.0), reference)


def test_spread_is_median_and_range_never_the_best() -> None:
    spread = Spread.of([3.0, 1.0, 10.0])
    assert spread == Spread(3.0, 1.0, 10.0)
    assert Spread.of([]) is None
    assert Spread.of([1.0, 2.0]) == Spread(1.5, 1.0, 2.0)


def test_rotation_puts_each_router_first_in_turn() -> None:
    assert [rotated("abc", r)[0] for r in range(4)] == ["a", "b", "c", "a"]
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert rotated([], 3) == []


def test_rounds_aggregate_by_label_with_reference_share(tmp_path: Path) -> None:
    rounds = Rounds()
    for cached, ttft in ((60, 0.2), (80, 0.4), (70, 0.3)):
        rounds.add("ttft", _run(cached, ttft))
    rounds.add("round_robin", _run(30, 1.0, reference=None))
    hit = rounds.spread("ttft", FIGURE_BY_KEY["hit_rate"])
    assert hit is not None
    # 3 later turns of 100 tokens and a first turn of 100 with nothing cached.
    assert (hit.median, hit.low, hit.high) == pytest.approx((0.525, 0.45, 0.6))
    share = rounds.spread("ttft", FIGURE_BY_KEY["of_reference"])
    assert share is not None and share.median == pytest.approx(0.525 / 0.8)
    assert rounds.spread("round_robin", FIGURE_BY_KEY["of_reference"]) is None
    rounds.save(tmp_path / "rounds.json")
    saved = orjson.loads((tmp_path / "rounds.json").read_bytes())
    assert saved["ttft"]["rounds"] == 3
    assert saved["ttft"]["ttft_p50"] == pytest.approx({"median": 0.3, "min": 0.2, "max": 0.4})
    assert saved["round_robin"]["of_reference"] is None


def test_cells_show_median_then_range() -> None:
    figure = FIGURE_BY_KEY["ttft_p90"]
    assert show_spread(Spread(0.25, 0.2, 1.5), figure) == "250 ms (200 ms-1.50 s)"
    assert show_spread(Spread(0.25, 0.25, 0.25), figure) == "250 ms"
    assert show_spread(None, figure) == "-"
    rounds = Rounds()
    rounds.add("ttft", _run(60, 0.2))
    rounds.add("ttft", _run(80, 0.4))
    console = Console(width=200, record=True)
    print_rounds(console, rounds)
    text = console.export_text()
    assert "52.5% (45.0%-60.0%)" in text and "over 2 round(s)" in text


def test_an_80_column_table_never_cuts_a_figure() -> None:
    rounds = Rounds()
    for label in ("round_robin", "cache_aware", "ttft"):
        for cached, ttft in ((61, 12.25), (83, 0.437), (72, 3.312)):
            rounds.add(label, _run(cached, ttft, reference=0.77))
    console = Console(width=80, record=True)
    print_rounds(console, rounds)
    lines = console.export_text().splitlines()
    for figure in FIGURE_BY_KEY.values():
        spread = rounds.spread("ttft", figure)
        if spread is None:
            continue
        median, _, range_ = show_spread(spread, figure).partition(" (")
        assert any(median in line for line in lines), (median, lines)
        assert not range_ or any(f"({range_}" in line for line in lines), (range_, lines)


def test_a_runs_ttft_objective_gives_the_rounds_their_goodput() -> None:
    """The objective kept in a result's meta reaches the rounds' figures: 4 turns over
    10 s, all within 0.5 s, then none within 0.1 s; without one, no goodput figure."""
    result_records = tuple(
        RequestRecord("s", t, float(t), 0.3, 1.0, 100, 0, 0, 10, None, None, 200) for t in range(4)
    )
    rounds = Rounds()
    for slo in (0.5, 0.1):
        meta = RunMeta("http://x", "t", "m", 1.0, 1, "2026-01-01", 10.0, slo_ttft_s=slo)
        rounds.add("ttft", ScoredRun.of(RunResult(meta, result_records)))
    goodput = rounds.spread("ttft", FIGURE_BY_KEY["goodput_per_s"])
    assert goodput is not None and (goodput.low, goodput.high) == pytest.approx((0.0, 0.4))
    plain = Rounds()
    plain.add(
        "ttft", ScoredRun.of(RunResult(RunMeta("u", "t", "m", 1.0, 1, "d", 10.0), result_records))
    )
    assert plain.spread("ttft", FIGURE_BY_KEY["goodput_per_s"]) is None


def test_every_comparison_takes_the_objective_and_the_retries_from_its_flags() -> None:
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    parser.set_defaults(policies="ttft", out=Path("/tmp/x"))
    config = demo_config(parser.parse_args(["--slo-ttft", "2", "--retries", "2"]))
    assert (config.slo_ttft_s, config.retries) == (2.0, 2)
    plain = demo_config(parser.parse_args([]))
    assert (plain.slo_ttft_s, plain.retries) == (None, 0)
