"""``kvrouter bench failure``: the figures on hand-made records, and one short run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from rich.console import Console

from bench.compare.demo import DemoConfig
from bench.failure.figures import (
    affected_sessions,
    hit_rate_between,
    hit_rate_buckets,
    next_turns_ttft,
    reprefilled_tokens,
    turns_after,
)
from bench.failure.run import FailureConfig, run_failure
from bench.ports import free_port_run
from bench.replay.result import RequestRecord
from bench.workloads.agent import AgentParams, generate
from bench.workloads.sampling import LogNormal
from bench.workloads.trace import Turn


def rec(
    session: str,
    turn: int,
    start: float,
    worker: str | None = "w0",
    *,
    ttft: float | None = 0.1,
    prompt: int = 1000,
    cached: int = 0,
    error: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        session=session,
        turn=turn,
        start=start,
        ttft_s=ttft,
        latency_s=1.0,
        prompt_tokens=prompt,
        cached_tokens=cached,
        oracle_cached_tokens=0,
        completion_tokens=10,
        worker=worker,
        error=error,
        status=500 if error else 200,
    )


KILL = 100.0
RECORDS = (
    # a: on w0 until the kill, then elsewhere
    rec("a", 0, 10, "w0"),
    rec("a", 1, 90, "w0"),
    rec("a", 2, 101, "w1", ttft=2.0, prompt=3000),
    rec("a", 3, 110, "w1", ttft=0.2, prompt=3500, cached=3000),
    rec("a", 4, 120, "w1", ttft=0.3, prompt=4000, cached=3500),
    rec("a", 5, 130, "w1", ttft=9.0, prompt=4500, cached=4000),
    # b: moved off w0 before the kill: not affected
    rec("b", 0, 20, "w0"),
    rec("b", 1, 95, "w1"),
    rec("b", 2, 105, "w1", prompt=2000, cached=1900),
    # c: its last request before the kill was on w0 and failed with it (in flight)
    rec("c", 0, 50, "w1"),
    rec("c", 1, 99, "w0", ttft=None, error="disconnected"),
    rec("c", 2, 104, "w2", ttft=4.0, prompt=2000),
    rec("c", 3, 200, "w2", ttft=0.5, prompt=2500, cached=2000, error="boom"),
    # d: on w0, but its request with no worker named (nothing came back) does not count
    rec("d", 0, 60, "w0"),
    rec("d", 1, 98, None, ttft=None, error="connect"),
)


def test_affected_sessions_are_those_whose_last_request_before_the_kill_was_on_it() -> None:
    assert affected_sessions(RECORDS, "w0", KILL) == {"a", "c", "d"}
    assert affected_sessions(RECORDS, "w1", KILL) == {"b"}
    assert affected_sessions(RECORDS, "w0", 15) == {"a"}  # nothing had started else


def test_next_turns_are_each_sessions_first_three_from_the_kill() -> None:
    after = turns_after(RECORDS, {"a", "c"}, KILL, 3)
    assert [(r.session, r.turn) for r in after] == [
        ("a", 2),
        ("c", 2),
        ("a", 3),
        ("a", 4),
        ("c", 3),
    ]
    assert len(turns_after(RECORDS, {"a"}, KILL)) == 4
    ttft = next_turns_ttft(RECORDS, {"a", "c"}, KILL)
    # a's 2.0, 0.2, 0.3 and c's 4.0; c's turn 3 failed
    assert ttft.requests == 4
    assert ttft.p50 == pytest.approx(1.15)
    assert ttft.p99 == pytest.approx(2.0 + (4.0 - 2.0) * 0.97)


def test_hit_rate_over_a_window_weights_tokens_of_successful_requests() -> None:
    # starts in [100, 160): a2..a5, b2, c2 (c3 starts later and failed)
    prompt = 3000 + 3500 + 4000 + 4500 + 2000 + 2000
    cached = 3000 + 3500 + 4000 + 1900
    assert hit_rate_between(RECORDS, KILL, KILL + 60) == pytest.approx(cached / prompt)
    assert hit_rate_between(RECORDS, 300, 360) is None
    buckets = hit_rate_buckets(RECORDS, 100.0)
    assert [t for t, _ in buckets] == [0.0, 100.0, 200.0]
    assert buckets[0][1] == 0.0
    assert buckets[2][1] is None  # c3 failed
    aligned = hit_rate_buckets(RECORDS, 60.0, origin=KILL)
    assert [t for t, _ in aligned] == [-20.0, 40.0, 100.0, 160.0]
    assert aligned[2][1] == hit_rate_between(RECORDS, KILL, KILL + 60)


def test_reprefilled_tokens_are_the_excess_over_the_same_turns_without_a_failure() -> None:
    baseline = [
        rec("a", 2, 101, "w0", prompt=3000, cached=2800),
        rec("a", 3, 110, "w0", prompt=3500, cached=3000),
        rec("a", 4, 120, "w0", prompt=4000, cached=3500),
        # a5 failed in the baseline: the pair is left out
        rec("a", 5, 130, "w0", prompt=4500, error="boom"),
        rec("c", 2, 104, "w0", prompt=2000, cached=1500),
    ]
    result = reprefilled_tokens(RECORDS, baseline, {"a", "c"}, KILL)
    # a2: 3000 - 200; a3, a4: 0; c2: 2000 - 500; c3 failed in this run
    assert result.pairs == 4
    assert result.tokens == 2800 + 1500
    assert reprefilled_tokens(baseline, baseline, {"a", "c"}, KILL).tokens == 0


def small_workload(config: DemoConfig) -> list[Turn]:
    """Four sessions of two turns, the first turn's reply followed by a pause of 110-130 s
    simulated: a worker killed soon after their first turns is replaced (a process start
    and a migration: 1 s of wall clock on an idle machine, 2.5 s seen under load, 20-50 s
    simulated) well before their second turns, ~90 s after the kill."""
    params = AgentParams(
        sessions=4,
        rate=0.5,
        turns=LogNormal(median=2, sigma=0.1, low=2, high=2),
        tool_result=LogNormal(median=800, sigma=0.5, low=100, high=3000),
        tool_time=LogNormal(median=120.0, sigma=0.05, low=110.0, high=130.0),
        output=LogNormal(median=60, sigma=0.3, low=20, high=120),
        max_context_tokens=20_000,
    )
    return generate(params, config.seed)


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_short_run_kills_restores_and_reports(tmp_path: Path) -> None:
    """End to end (~35 s wall; slow): two engines, four short sessions, one round of
    every scenario; the restore's checkpoint, migrate and removal go through the admin
    API."""
    base = free_port_run(4)
    demo = DemoConfig(
        engines=2,
        kv_tokens=60_000,
        time_scale=20.0,
        out=tmp_path,
        base_port=base + 1,
        router_port=base,
        repeat=1,
        clock="real",
    )
    config = FailureConfig(demo=demo, kill_at=30.0, checkpoint_before=10.0, restart_after=0.0)
    rounds = await run_failure(config, Console(width=200), small_workload)
    (round_,) = rounds
    figures = round_.figures
    assert set(figures) == {"none", "cold", "restore", "gone"}
    assert figures["none"].reprefilled == 0
    assert figures["none"].errors == 0
    for scenario in ("cold", "restore", "gone"):
        assert figures[scenario].events.kill is not None
    assert figures["restore"].events.checkpoint is not None
    assert figures["restore"].events.removed is not None
    assert (figures["restore"].events.moved_tokens or 0) > 0
    # The affected sessions' next turns come after the restored engine is up and hit on
    # what it restored.
    restored = [r for r in round_.results["restore"].records if r.worker == "w0r"]
    assert any(r.cached_tokens > 0 for r in restored), "nothing hit on the restored worker"
    assert (figures["restore"].reprefilled or 0) < (figures["cold"].reprefilled or 0)
    for name in ("failure.json", "failure_hit_rate.png", "failure_affected_ttft.png"):
        assert (tmp_path / name).is_file()
    assert (tmp_path / "restore.r1.json").is_file()


def test_a_config_refuses_the_virtual_clock_and_unknown_scenarios() -> None:
    with pytest.raises(ValueError, match="real clock"):
        FailureConfig(demo=DemoConfig(clock="virtual"))
    with pytest.raises(ValueError, match="unknown scenarios"):
        FailureConfig(scenarios=("none", "meteor"))
    with pytest.raises(ValueError, match="checkpoint"):
        FailureConfig(kill_at=10.0, checkpoint_before=20.0)
    assert FailureConfig().restart_delay == 50.0
    assert dataclasses.replace(FailureConfig(), restart_after=5.0).restart_delay == 5.0
