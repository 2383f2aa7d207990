"""Offered load: sessions re-timed to bring a multiple of the measured capacity, the
capacity read from a saturated run, and the comparison's router with its queue on."""

from __future__ import annotations

import argparse
from pathlib import Path

import aiohttp
import pytest

from bench.compare.demo import DemoConfig, RouterSpec, kvrouter_command
from bench.compare.matrix import _description, _loads
from bench.compare.matrix_plots import load_of, write_load_plots
from bench.compare.offered_load import router_queue, saturated_turns_per_s
from bench.replay.result import RequestRecord, RunMeta, RunResult
from bench.replay.rounds import Rounds, ScoredRun
from bench.throughput.run import policies_of
from bench.workloads.agent import AgentParams, generate
from bench.workloads.load import all_at_once, at_load, session_rate, turns_per_session
from bench.workloads.trace import Turn, group_sessions
from router.config import AdmissionConfig
from router.observability.queue_metrics import HOLD_REASONS
from tests.conftest import EngineFactory, router_config, serve_router
from tests.router_client import chat_body, engines, post


def _agent() -> list[Turn]:
    return generate(AgentParams(sessions=20, rate=0.05), seed=3)


def test_a_load_sets_the_session_rate_from_the_capacity() -> None:
    turns = _agent()
    per_session = turns_per_session(turns)
    capacity = 2.0  # turns a second
    for load in (0.5, 1.0, 2.0):
        retimed = at_load(turns, load, capacity)
        assert session_rate(retimed) == pytest.approx(load * capacity / per_session)
        # Each session keeps its turns' own times relative to its start.
        for before, after in zip(group_sessions(turns), group_sessions(retimed), strict=True):
            shift = after.arrival - before.arrival
            assert [t.arrival - shift for t in after.turns] == pytest.approx(
                [t.arrival for t in before.turns]
            )
    assert session_rate(at_load(turns, 2.0, capacity)) == pytest.approx(
        2 * session_rate(at_load(turns, 1.0, capacity))
    )


def test_all_at_once_starts_every_session_with_the_first() -> None:
    sessions = group_sessions(all_at_once(_agent()))
    assert len({s.arrival for s in sessions}) == 1
    with pytest.raises(ValueError, match="all at once"):
        at_load(all_at_once(_agent()), 1.0, 2.0)


def test_capacity_is_the_completion_rate_while_saturated() -> None:
    # Two turns a second for 50 s, then a slow tail (one every 10 s for 200 s).
    ends = [i * 0.5 for i in range(100)] + [50.0 + 10.0 * i for i in range(1, 21)]
    records = [
        RequestRecord("s", i, end - 0.5, 0.1, 0.5, 10, 0, 0, 1, None, None, 200)
        for i, end in enumerate(ends)
    ]
    assert saturated_turns_per_s(records) == pytest.approx(2.0, rel=0.05)
    with pytest.raises(ValueError, match="too few"):
        saturated_turns_per_s(records[:5])


def test_a_queue_label_turns_the_routers_queue_on_with_its_settings() -> None:
    config = DemoConfig()
    plain = kvrouter_command(config, "ttft", ["http://e"], 1)
    assert "--admission" not in plain and plain[plain.index("--policy") + 1] == "ttft"
    queued = kvrouter_command(config, "ttft+queue:queue_timeout_s=3", ["http://e"], 1)
    assert queued[queued.index("--policy") + 1] == "ttft"
    settings = [queued[i + 1] for i, arg in enumerate(queued) if arg == "--admission"]
    assert settings == ["enabled=true", "queue_timeout_s=3"]


def test_on_the_real_clock_the_queues_times_are_the_engines() -> None:
    # Engines ten times faster than real: ten simulated seconds are one of the router's.
    real = DemoConfig(clock="real", time_scale=10.0)
    label = "ttft+queue:queue_timeout_s=3:ttft_target_s=5"
    queued = kvrouter_command(real, label, ["http://e"], 1)
    settings = dict(
        queued[i + 1].split("=") for i, arg in enumerate(queued) if arg == "--admission"
    )
    assert settings == {
        "enabled": "true",
        "max_queued_prefill_s": "0.1",
        "queue_timeout_s": "0.3",
        "first_turn_queue_timeout_s": "0.2",
        "ttft_target_s": "0.5",
        "door_window_s": "3",
        "batch_queue_timeout_s": "6",
        "min_retry_after_s": "0.1",
    }


def test_loads_are_read_and_described() -> None:
    assert _loads("0.5,1,2") == (0.5, 1.0, 2.0)
    for bad in ("fast", "0,1", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            _loads(bad)
    assert _description("agent 1.5x", {"agent": "agents"}) == (
        "agents, sessions bringing 1.5x the measured capacity"
    )


async def test_the_queue_figures_come_from_the_routers_metrics(
    engine_factory: EngineFactory,
) -> None:
    spec = RouterSpec("ttft+queue", (), ())
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, admission=AdmissionConfig(enabled=True))) as router,
        aiohttp.ClientSession() as http,
    ):
        for _ in range(3):
            body = chat_body([{"role": "user", "content": "hi"}])
            assert (await post(http, router.url, body)).status == 200
        figures = await router_queue(spec, [router.url], scale=10.0)
        # Three requests went at once (waits of 0: the first bucket, 5 ms), none shed.
        held = {f"queue_held_{reason}": 0.0 for reason in HOLD_REASONS}
        assert figures == {
            "queue_wait_p99": 0.05,
            "queue_wait_mean": 0.0,
            "queue_sheds": 0.0,
            **held,
        }
        assert await router_queue(spec, [fleet[0].url]) == {}  # an engine: no such series


def _rounds(ttft_s: float) -> Rounds:
    records = tuple(
        RequestRecord("s", t, float(t), ttft_s, 1.0, 100, 50, 50, 10, None, None, 200)
        for t in range(4)
    )
    meta = RunMeta("http://x", "t", "m", 1.0, 1, "2026-01-01", 10.0, slo_ttft_s=0.5)
    rounds = Rounds()
    for label in ("ttft", "ttft+queue"):
        rounds.add(label, ScoredRun.of(RunResult(meta, records)))
    return rounds


def test_rows_at_offered_loads_are_plotted_against_the_load(tmp_path: Path) -> None:
    assert load_of("agent 1.5x") == ("agent", 1.5)
    assert load_of("agent") is None and load_of("mix overload") is None
    results = {"agent 0.5x": _rounds(0.1), "agent 2x": _rounds(1.0), "chat": _rounds(0.1)}
    written = write_load_plots(results, tmp_path)
    assert [p.name for p in written] == ["load-agent.png"]
    assert written[0].stat().st_size > 10_000


def test_the_throughput_bench_costs_a_queued_policys_prompt_as_the_policys() -> None:
    # Found: bench throughput --policies ttft,ttft+queue measured every round, then
    # failed building the policy "ttft+queue" for the prompt's cost.
    assert policies_of(["ttft", "ttft+queue", "cache_aware+queue:queue_timeout_s=3"]) == [
        "ttft",
        "cache_aware",
    ]
