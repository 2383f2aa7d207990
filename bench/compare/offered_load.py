"""A comparison at several offered loads, as multiples of the fleet's measured capacity
(``--load 0.5,1,1.5,2``): overload as users meet it, a fixed arrival rate of sessions.

First the capacity: every session of the workload (round 1's seed) starts at once
through kvrouter's ``ttft`` without its queue, and the turns completed a second while
the fleet is saturated are counted (``bench.workloads.load``). Then, per load, the usual
comparison (``run_comparison``: every router, ``repeat`` rounds) with each round's
sessions re-timed to bring that load, and the replay's in-flight bound lifted, so that
turns pile up where the routers put them (at the router, in the engines' queues), not
in the client.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from bench.compare.demo import (
    REQUEST_TIMEOUT_S,
    DemoConfig,
    RouterSpec,
    RouterSpecs,
    Workload,
    demo_workload,
    engines_for,
    kvrouter_spec,
    router_for,
    run_comparison,
)
from bench.replay.client import discover_model
from bench.replay.result import RequestRecord
from bench.replay.rounds import Rounds
from bench.replay.runner import ReplayConfig, replay, select_sessions
from bench.workloads.load import all_at_once, at_load
from bench.workloads.trace import write_trace

# No bound a benchmark's fleet comes near: the client never holds a turn back.
OPEN_LOOP_CONCURRENCY = 100_000
PROBE_POLICY = "ttft"
# The saturated window: from the 10th to the 60th percentile of turn completions, when
# the sessions started at once are all still running (the rest is the long sessions'
# tail, with the fleet no longer full).
SATURATED_FROM, SATURATED_TO = 0.1, 0.6


def load_label(title: str, load: float) -> str:
    return f"{title} {load:g}x"


def load_directory(row_out: Path, load: float) -> Path:
    """Where a row's runs at one offered load are written (``agent/load-1.5x``)."""
    return row_out / f"load-{load:g}x"


def loads_written(row_out: Path) -> list[tuple[float, Path]]:
    """The offered loads a row was run at, from its directories, lowest first."""
    found = []
    for path in row_out.glob("load-*x"):
        try:
            load = float(path.name.removeprefix("load-").removesuffix("x"))
        except ValueError:
            continue
        # Only the names the matrix writes (not load-nanx, load-1_5x or load-1.0x).
        written = math.isfinite(load) and load > 0 and path == load_directory(row_out, load)
        if written and path.is_dir():
            found.append((load, path))
    return sorted(found)


async def measure_capacity(
    config: DemoConfig,
    console: Console,
    workload: Workload = demo_workload,
    per_engine_flags: Sequence[Sequence[str]] = (),
) -> float:
    """Turns a second the fleet completes with every session started at once."""
    config.out.mkdir(parents=True, exist_ok=True)
    turns = all_at_once(workload(config))
    trace = config.out / "capacity-probe.jsonl"
    write_trace(turns, trace)
    async with engines_for(config, per_engine_flags) as engines:
        urls = [e.url for e in engines]
        async with aiohttp.ClientSession() as http:
            model = await discover_model(http, urls[0])
        spec = kvrouter_spec(config, PROBE_POLICY, urls)
        async with router_for(config, spec) as router_urls:
            probe = ReplayConfig(
                target=router_urls[0],
                trace=trace,
                model=model,
                time_scale=config.engine_time_scale,
                request_timeout_s=REQUEST_TIMEOUT_S,
                api=config.api,
                concurrency=OPEN_LOOP_CONCURRENCY,
            )
            result = await replay(probe, select_sessions(turns))
    capacity = saturated_turns_per_s(result.records)
    console.print(
        f"capacity: {capacity:.3g} turns/s ({len(turns)} turns of {len(select_sessions(turns))} "
        f"sessions started at once, {PROBE_POLICY})"
    )
    return capacity


async def run_at_loads(
    config: DemoConfig,
    console: Console,
    specs_for: RouterSpecs,
    workload: Workload = demo_workload,
    per_engine_flags: Sequence[Sequence[str]] = (),
    title: str = "agent",
) -> dict[str, Rounds]:
    """The comparison at each of ``config.loads``; keys ``"<title> <load>x"``."""
    capacity = await measure_capacity(config, console, workload, per_engine_flags)
    _save_capacity(config.out / "capacity.json", capacity, config.loads)
    results: dict[str, Rounds] = {}
    for load in config.loads:
        label = load_label(title, load)
        console.rule(f"{label}: sessions bring {load:g} x {capacity:.3g} turns/s")
        at = dataclasses.replace(
            config, out=load_directory(config.out, load), concurrency=OPEN_LOOP_CONCURRENCY
        )
        results[label] = await run_comparison(
            at,
            console,
            specs_for,
            workload=workload,
            per_engine_flags=per_engine_flags,
            title=label,
            after_each=functools.partial(router_queue, scale=config.engine_time_scale),
            retime=functools.partial(at_load, load=load, capacity_turns_per_s=capacity),
        )
    return results


async def router_queue(
    spec: RouterSpec, urls: Sequence[str], scale: float = 1.0
) -> dict[str, float]:
    """What kvrouter's queue did in the run, from its /metrics (summed over replicas):
    the admitted requests' wait, p99 (a bucket's upper bound) and mean, in simulated
    seconds (the router's times ``scale``), the requests it shed, and how many it held
    for each reason. Nothing for a router without those series (a peer)."""
    buckets: dict[float, float] = {}
    held: dict[str, float] = {}
    total = count = sheds = 0.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        for url in urls:
            async with http.get(url + "/metrics") as response:
                if response.status != 200:
                    return {}
                text = await response.text()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "kvrouter_queue_wait_seconds_bucket":
                        le = float(sample.labels["le"])
                        buckets[le] = buckets.get(le, 0.0) + sample.value
                    elif sample.name == "kvrouter_queue_wait_seconds_sum":
                        total += sample.value
                    elif sample.name == "kvrouter_queue_wait_seconds_count":
                        count += sample.value
                    elif sample.name == "kvrouter_queue_sheds_total":
                        sheds += sample.value
                    elif sample.name == "kvrouter_queue_held_total":
                        reason = f"queue_held_{sample.labels['reason']}"
                        held[reason] = held.get(reason, 0.0) + sample.value
    if not count:
        return {}
    p99 = next(le for le, n in sorted(buckets.items()) if n >= 0.99 * count)
    return {
        "queue_wait_p99": p99 * scale,
        "queue_wait_mean": total / count * scale,
        "queue_sheds": sheds,
        **held,
    }


def _save_capacity(path: Path, capacity: float, loads: Sequence[float]) -> None:
    path.write_bytes(
        orjson.dumps(
            {"capacity_turns_per_s": capacity, "loads": list(loads)}, option=orjson.OPT_INDENT_2
        )
    )


def saturated_turns_per_s(records: Sequence[RequestRecord]) -> float:
    """Turns completed a second between the 10th and 60th percentile of completions."""
    ends = sorted(r.start + r.latency_s for r in records if r.error is None)
    if len(ends) < 10:
        raise ValueError("too few completed turns to measure a capacity")
    low = ends[int(len(ends) * SATURATED_FROM)]
    high = ends[int(len(ends) * SATURATED_TO)]
    if high <= low:
        raise ValueError("the completions have no span to measure a capacity over")
    done = sum(1 for end in ends if low < end <= high)
    return done / (high - low)
