"""``kvrouter bench agreement``'s scoring, from request-log lines as the router writes them."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from bench.compare.agreement import (
    agreement_of,
    engine_flags,
    join_arrivals,
    queued_evictions,
    router_pids,
)
from bench.compare.demo import DemoConfig
from bench.compare.matrix import rows as matrix_rows


def line(ts: float, session: str | None, predicted: int, engine: int | None, **over: Any) -> Any:
    return {
        "ts": ts,
        "session": session,
        "outcome": "success",
        "predicted_cached_tokens": predicted,
        "engine_cached_tokens": engine,
        **over,
    }


def test_later_turns_are_scored_within_one_block_and_first_turns_are_not() -> None:
    lines = [
        line(3.0, "a", 1000, 1000),  # within
        line(1.0, "a", 0, 0),  # a's first turn, whatever its order in the log
        line(2.0, "b", 500, 0),  # b's first: not scored though it is far off
        line(4.0, "b", 2000, 1984),  # within: one block
        line(5.0, "b", 2000, 1983),  # over by more than a block
        line(6.0, "a", 0, 3000),  # under
        line(7.0, "a", 3000, None),  # no usage: not scored
        line(8.0, "a", 3000, 0, outcome="upstream_error"),
        line(9.0, None, 10, 10),  # no session: nothing to follow
    ]
    scored = agreement_of(lines)
    assert (scored.later_turns, scored.within, scored.over, scored.under) == (4, 2, 1, 1)
    assert scored.shares()["agreement"] == 0.5


def test_the_routers_processes_are_found_by_their_port() -> None:
    port = 54321
    process = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "serve", "--port", str(port)]
    )
    try:
        # Once, in a full suite run, the process just started was not found at the first
        # look (cause not established): look again for a while before failing.
        deadline = time.monotonic() + 10
        while router_pids(port) != [process.pid] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert router_pids(port) == [process.pid]
        assert router_pids(port + 1) == []
    finally:
        process.kill()
        process.wait()


def test_predictions_are_also_held_to_what_the_engine_held_at_arrival() -> None:
    lines = [
        line(1.0, "a", 0, 0, request_id="r1"),
        line(2.0, "a", 1000, 600, request_id="r2"),  # held 1000 at arrival, 600 scheduled
        line(3.0, "a", 1000, 1000, request_id="r3"),
        line(4.0, "a", 800, 800, request_id="r4"),  # the engine kept no record of it
    ]
    records: list[dict[str, Any]] = [
        {"request_id": "r1", "cached_at_arrival": 0},
        {"request_id": "r2", "cached_at_arrival": 1000},
        {"request_id": "r3", "cached_at_arrival": 1000},
        {"request_id": None, "cached_at_arrival": 5},
    ]
    joined = join_arrivals(lines, records)
    assert agreement_of(joined).shares()["agreement"] == 2 / 3
    at_arrival = agreement_of(joined, reported="cached_at_arrival")
    assert (at_arrival.later_turns, at_arrival.within) == (2, 2)
    assert queued_evictions(joined) == 1 / 3


def test_a_matrix_rows_engine_flags_come_before_the_tokenizer_and_events() -> None:
    slow = {row.name: row for row in matrix_rows()}["slow-worker"]
    config = dataclasses.replace(DemoConfig(), engines=3)
    flags = engine_flags(config, Path("/models/qwen3"), 5700, slow.per_engine_flags)

    assert flags[0][:2] == ["--gpu", "a100"]
    assert all("--gpu" not in later for later in flags[1:])
    endpoints = [orjson.loads(f[f.index("--kv-events-config") + 1])["endpoint"] for f in flags]
    assert endpoints == ["tcp://*:5700", "tcp://*:5702", "tcp://*:5704"]
