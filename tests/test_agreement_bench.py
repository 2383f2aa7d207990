"""``kvrouter bench agreement``'s scoring, from request-log lines as the router writes them."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from bench.agreement import agreement_of, router_pids


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
        assert router_pids(port) == [process.pid]
        assert router_pids(port + 1) == []
    finally:
        process.kill()
        process.wait()
