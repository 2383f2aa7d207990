"""The benchmarks' virtual-time mode: engines, router and replay in one looptime loop."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from bench.compare.demo import DemoConfig, RouterSpec, kvrouter_spec, run_comparison
from bench.compare.inprocess import router_argv, run_virtual
from bench.compare.rescore import rescore_row
from bench.ports import free_port_run
from bench.replay.reference import ReferenceParams
from bench.replay.rounds import FIGURE_BY_KEY, Rounds


async def _routers_read(spec: RouterSpec, urls: Sequence[str]) -> dict[str, float]:
    """Figures read from the routers after each run, as the queue's are (a wait past the
    histogram's last bucket reads as inf)."""
    return {"routers": float(len(urls)), "queue_wait_p99": math.inf}


def _compare(out: Path) -> Rounds:
    base = free_port_run(3)  # two engines on base and base + 1, the router on base + 2
    config = DemoConfig(
        engines=2,
        sessions=2,
        rate=0.5,
        kv_tokens=40_000,
        repeat=2,
        policies=("ttft", "round_robin"),
        out=out,
        base_port=base,
        router_port=base + 2,
    )
    with (out.parent / f"{out.name}.log").open("w") as log:
        return run_virtual(
            run_comparison(
                config,
                Console(file=log, width=120),
                lambda urls: [kvrouter_spec(config, p, urls) for p in config.policies],
                after_each=_routers_read,
            )
        )


def test_virtual_time_runs_give_the_same_answer_twice(tmp_path: Path) -> None:
    """Two separate comparisons agree round for round, exactly on what routing decided
    (hit rate) and to the float's noise on timings; the rounds themselves draw other
    workload seeds, so they differ."""
    first, second = _compare(tmp_path / "a"), _compare(tmp_path / "b")
    for label in ("ttft", "round_robin"):
        for key in ("hit_rate", "ttft_p50", "ttft_p90", "missed_share"):
            figure = FIGURE_BY_KEY[key]
            for one, other in zip(first.runs[label], second.runs[label], strict=True):
                a, b = figure.value(one), figure.value(other)
                assert a is not None and b is not None
                assert abs(a - b) <= 1e-9 * max(1.0, abs(a)), (label, key, a, b)
        hits = [run.summary.hit_rate for run in first.runs[label]]
        assert len(hits) == 2 and hits[0] != hits[1]  # two seeds, two workloads
    hit = FIGURE_BY_KEY["hit_rate"]
    ttft, round_robin = (first.spread(p, hit) for p in ("ttft", "round_robin"))
    assert ttft is not None and round_robin is not None
    assert ttft.median > round_robin.median  # the runs measured routing, not nothing
    assert (tmp_path / "a" / "rounds.json").exists()
    read = {"routers": 1.0, "queue_wait_p99": math.inf}
    assert first.runs["ttft"][1].extras == read
    # kept beside each run's records, which cannot rebuild them, for bench rescore
    rescored = rescore_row(tmp_path / "a", ReferenceParams(2, 40_000))
    assert [run.extras for run in rescored.runs["round_robin"]] == [read, read]


def test_only_kvrouter_commands_run_in_virtual_time() -> None:
    assert router_argv(["python", "-m", "router.cli", "serve", "--port", "1"]) == [
        "serve",
        "--port",
        "1",
    ]
    try:
        router_argv(["/opt/peers/bin/smg", "launch"])
    except ValueError as exc:
        assert "virtual time" in str(exc)
    else:
        raise AssertionError("a peer router was accepted")
