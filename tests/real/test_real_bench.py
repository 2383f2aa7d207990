"""``kvrouter bench real``'s pure parts: the figures from a run's records and request-log
lines, the routers' settings and the workload's size. No engine is started here."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.listeners import pids_listening
from bench.real.figures import RouterCpu, figures_json, markdown_table, run_extras
from bench.real.routers import (
    DEFAULT_ROUTERS,
    RouterChoice,
    kvrouter_settings,
    router_specs,
)
from bench.real.vllm_cpu import (
    BLOCK_TOKENS,
    NUM_BLOCKS,
    EngineExited,
    VllmEngine,
    watch,
)
from bench.real.workload import MAX_CONTEXT_TOKENS, RealWorkload, context_tokens
from bench.replay.result import RequestRecord, RunMeta, RunResult
from bench.replay.rounds import Rounds, ScoredRun
from bench.workloads.trace import group_sessions, text_tokens
from router.config_loader import load_config
from tests.bench.test_agreement_bench import line


def test_agreement_is_held_to_the_engines_32_token_block() -> None:
    lines = [
        line(1.0, "a", 0, 0),  # a first turn: not scored
        line(2.0, "a", 800, 768),  # 32 tokens apart: within one block
        line(3.0, "a", 1000, 960),  # 40 over
        line(4.0, "a", 900, 1024),  # 124 under
    ]
    extras = run_extras(lines, requests=4, cpu=RouterCpu(seconds=0.2, wall_s=10.0, idle_per_s=0.01))
    assert extras["later_turns"] == 3
    assert extras["agreement"] == pytest.approx(1 / 3)
    assert extras["over_predicted"] == pytest.approx(1 / 3)
    assert extras["under_predicted"] == pytest.approx(1 / 3)
    assert extras["router_cpu_per_request"] == pytest.approx(0.05)
    assert extras["router_busy_cpu_per_request"] == pytest.approx(0.025)  # 0.1 s idle
    assert extras["router_idle_cpu_share"] == pytest.approx(0.01)


def test_a_router_without_kvrouters_log_has_cpu_but_no_agreement() -> None:
    cpu = RouterCpu(seconds=1.0, wall_s=100.0, idle_per_s=0.02)
    assert run_extras([], requests=10, cpu=cpu) == {
        "router_cpu_per_request": 0.1,
        "router_busy_cpu_per_request": 0.0,  # never below nothing
        "router_idle_cpu_share": 0.02,
    }
    assert run_extras([], requests=0, cpu=None) == {}


def record(turn: int, prompt: int, cached: int, ttft: float) -> RequestRecord:
    return RequestRecord(
        session="s",
        turn=turn,
        start=float(turn),
        ttft_s=ttft,
        latency_s=ttft + 1.0,
        prompt_tokens=prompt,
        cached_tokens=cached,
        oracle_cached_tokens=0,
        completion_tokens=32,
        worker=None,
        error=None,
        status=200,
    )


def run(hits: list[tuple[int, int]], extras: dict[str, float]) -> ScoredRun:
    records = tuple(record(i, p, c, 0.1 * (i + 1)) for i, (p, c) in enumerate(hits))
    meta = RunMeta("http://x", "trace", "m", 1.0, 1, "2026-01-01T00:00:00+00:00", 10.0)
    return ScoredRun.of(RunResult(meta, records), None, extras)


def test_rounds_become_medians_and_ranges_per_router() -> None:
    rounds = Rounds()
    rounds.add("ttft exact", run([(1000, 0), (1000, 800)], {"agreement": 1.0}))
    rounds.add("ttft exact", run([(1000, 0), (1000, 600)], {"agreement": 0.5}))
    rounds.add("smg", run([(1000, 0), (1000, 0)], {}))
    figures = figures_json(rounds)
    assert figures["ttft exact"]["rounds"] == 2
    assert figures["ttft exact"]["hit_rate"] == {"median": 0.35, "min": 0.3, "max": 0.4}
    assert figures["ttft exact"]["agreement"] == {"median": 0.75, "min": 0.5, "max": 1.0}
    assert figures["smg"]["agreement"] is None
    table = markdown_table(rounds).splitlines()
    assert table[0] == "| metric | ttft exact | smg |"
    assert "| hit rate (engines' usage) | 35.0% (30.0%-40.0%) | 0.0% |" in table
    assert any(row.startswith("| agreement") and row.endswith("| - |") for row in table)


def test_router_names_parse_and_unknown_ones_are_refused() -> None:
    choices = [RouterChoice.parse(name) for name in DEFAULT_ROUTERS]
    assert [c.label for c in choices][:3] == ["ttft text", "ttft tokens", "ttft exact"]
    assert choices[-1] == RouterChoice("smg")
    with pytest.raises(ValueError, match="POLICY:MODE"):
        RouterChoice.parse("ttft:bytes")


def engines() -> list[VllmEngine]:
    return [
        VllmEngine(Path("/venv"), Path("/m"), Path("/logs"), f"e{i}", port=8100 + i,
                   events_port=5700 + 2 * i, replay_port=5701 + 2 * i)
        for i in range(2)
    ]  # fmt: skip


def test_token_modes_key_by_the_engines_tokens_and_exact_reads_their_events() -> None:
    text = kvrouter_settings(RouterChoice("ttft", "text"), engines(), Path("/m"), 8000)
    tokens = kvrouter_settings(RouterChoice("ttft", "tokens"), engines(), Path("/m"), 8000)
    exact = kvrouter_settings(RouterChoice("ttft", "exact"), engines(), Path("/m"), 8000)
    assert "prefix" not in text
    assert tokens["prefix"] == {"tokenizer": "/m"}  # the block size is the router's to find
    assert "kv_events" not in tokens["workers"][0]
    assert exact["workers"][1]["kv_events"] == {
        "endpoint": "tcp://127.0.0.1:5702",
        "replay_endpoint": "tcp://127.0.0.1:5703",
    }
    assert all(s["log_requests"] and s["worker_header"] for s in (text, tokens, exact))


def test_every_routers_file_is_one_kvrouter_accepts(tmp_path: Path) -> None:
    choices = [RouterChoice.parse(name) for name in DEFAULT_ROUTERS]
    specs = router_specs(choices, engines(), tmp_path, tmp_path, Path("/peers/smg"))
    assert [spec.label for spec in specs] == [c.label for c in choices]
    assert specs[-1].commands[0][1] == "launch"
    exact = load_config(tmp_path / "ttft-exact.yaml")
    assert exact.subscribes_kv_events
    assert exact.prefix.block_bytes is None  # the router's 16-token blocks
    assert BLOCK_TOKENS % exact.prefix.block_tokens == 0
    assert len({spec.ports for spec in specs}) == len(specs)


def test_the_workload_fits_the_engines_context_and_overflows_their_cache() -> None:
    turns = RealWorkload().turns()
    sessions = group_sessions(turns)
    assert len(sessions) == 8
    assert all(4 <= len(session.turns) <= 6 for session in sessions)
    for session in sessions:
        system = session.turns[0].system
        assert system is not None
        context = text_tokens(system) + sum(
            text_tokens(t.user) + t.output_tokens for t in session.turns
        )
        assert context <= MAX_CONTEXT_TOKENS
    # Stand-in words are more than one Qwen3 token each: the fleet holds less still.
    assert context_tokens(turns) > 2 * NUM_BLOCKS * BLOCK_TOKENS
    # Replayed as text: a random model's calls are not written back as generated.
    assert all(t.ended_by is None for t in turns)


def test_a_routers_process_is_found_by_the_port_it_listens_on() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        assert pids_listening(port) == []  # bound, not yet listening
        listener.listen()
        assert pids_listening(port) == [os.getpid()]


def test_a_run_stops_as_soon_as_an_engine_exits(tmp_path: Path) -> None:
    engine = VllmEngine(Path("/venv"), Path("/m"), tmp_path, "e0")
    engine.process = subprocess.Popen([sys.executable, "-c", "pass"])
    engine.process.wait()
    with pytest.raises(EngineExited, match="e0 exited"):
        asyncio.run(watch([engine], interval_s=0.01))
