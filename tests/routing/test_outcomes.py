"""Per-turn outcomes and the cause of every lost prefix."""

from __future__ import annotations

import aiohttp

from bench.textgen import text_for
from router.config import HealthConfig
from router.observability.outcomes import SessionMemory, SessionTracker, classify
from tests.conftest import EngineFactory, router_config, serve_router
from tests.router_client import chat_body, conversation, engines, metric, post, wait_for

EPOCHS = {"a": 0, "b": 0}


def memory(worker: str = "a", epoch: int = 0, history: int = 1000) -> SessionMemory:
    return SessionMemory(worker, epoch, history)


def test_first_turn_hit_partial_miss() -> None:
    assert classify(None, "a", EPOCHS, 500, 0, 0, 0).outcome == "first_turn"
    assert classify(memory(), "a", EPOCHS, 1200, 950, 1000, 1000).outcome == "hit"
    partial = classify(memory(), "a", EPOCHS, 1200, 500, 1000, 1000)
    assert (partial.outcome, partial.lost_tokens) == ("partial", 500)
    assert classify(memory(), "a", EPOCHS, 1200, 0, 1000, 1000).outcome == "miss"


def test_a_hit_read_back_from_the_cpu_tier_is_reloaded() -> None:
    # The GPU was modelled to hold 400 of the 1,000-token history, the CPU tier 600 more.
    reloaded = classify(memory(), "a", EPOCHS, 1200, 1000, 1000, 1000, 400, 600)
    assert (reloaded.outcome, reloaded.cause) == ("reloaded", None)
    # Nothing found beyond the GPU's part: a plain hit, or a loss as before.
    assert classify(memory(), "a", EPOCHS, 1200, 950, 1000, 1000, 1000, 0).outcome == "hit"
    assert classify(memory(), "a", EPOCHS, 1200, 950, 1000, 1000, 960, 40).outcome == "hit"
    assert classify(memory(), "a", EPOCHS, 1200, 400, 1000, 1000, 400, 600).outcome == "partial"


def test_causes() -> None:
    def cause(
        previous: SessionMemory, worker: str, epochs: dict[str, int], best: int, predicted: int
    ) -> str | None:
        return classify(previous, worker, epochs, 1200, 0, best, predicted).cause

    assert cause(memory(), "a", {"a": 1, "b": 0}, 0, 0) == "worker_failed"  # restarted
    assert cause(memory(), "a", {"b": 0}, 0, 0) == "worker_failed"  # removed
    assert cause(memory(), "b", EPOCHS, 1000, 0) == "routed_elsewhere"
    assert cause(memory(), "a", EPOCHS, 1000, 1000) == "evicted"
    assert cause(memory(), "a", EPOCHS, 0, 0) == "router_state_lost"
    # Without a session key there is nothing to compare with.
    assert classify(None, "a", EPOCHS, 1200, 0, 1000, 1000).cause == "unknown"


def test_the_tracker_is_bounded() -> None:
    tracker = SessionTracker(max_sessions=3)
    for i in range(10):
        tracker.remember(f"s{i}", memory())
    assert len(tracker) == 3 and tracker.get("s0") is None and tracker.get("s9") is not None
    tracker.remember(None, memory())
    assert len(tracker) == 3


async def turn(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], key: str
) -> str:
    result = await post(http, url, chat_body(messages, max_tokens=16, user=key))
    assert result.status == 200
    messages += [
        {"role": "assistant", "content": result.text},
        {"role": "user", "content": "go on"},
    ]
    return str(result.worker)


async def test_outcomes_and_causes_end_to_end(engine_factory: EngineFactory) -> None:
    health = HealthConfig(interval_s=0.05, scrape_interval_s=0.05, stale_after_s=1.0)
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet, health=health, admin_token="t")) as router,
        aiohttp.ClientSession() as http,
    ):
        messages = conversation("outcomes", 600, 100)
        worker = await turn(http, router.url, messages, "s1")  # first turn
        await turn(http, router.url, messages, "s1")  # hit
        assert await metric(http, router, "kvrouter_turns_total", outcome="first_turn") == 1
        assert await metric(http, router, "kvrouter_turns_total", outcome="hit") == 1

        # Drained: the next turn must go elsewhere and re-read its history. It also adds
        # a long tool result, so the drained worker will hold under 90% of what follows.
        await http.post(
            f"{router.url}/admin/workers/{worker}/drain", headers={"Authorization": "Bearer t"}
        )
        messages[-1]["content"] = text_for("tool-result", 3000)
        other = await turn(http, router.url, messages, "s1")
        assert other != worker
        assert (
            await metric(http, router, "kvrouter_lost_prefix_turns_total", cause="routed_elsewhere")
            == 1
        )

        # The worker now holding it restarts: its cache is gone.
        engine = fleet[int(other[1])]
        async with http.post(engine.url + "/sim/restart"):
            pass

        async def restart_seen() -> bool:
            return await metric(http, router, "kvrouter_worker_restarts_total") == 1

        await wait_for(restart_seen)
        await http.delete(
            f"{router.url}/admin/workers/{worker}/drain", headers={"Authorization": "Bearer t"}
        )
        await turn(http, router.url, messages, "s1")
        assert (
            await metric(http, router, "kvrouter_lost_prefix_turns_total", cause="worker_failed")
            == 1
        )
        assert await metric(http, router, "kvrouter_lost_prefix_tokens_total") > 0
        assert (
            await metric(
                http, router, "kvrouter_turn_time_to_first_token_seconds_count", outcome="hit"
            )
            == 1
        )


def test_sessions_migrated_with_their_workers_state_are_judged_on_the_new_worker() -> None:
    tracker = SessionTracker()
    tracker.remember("s1", SessionMemory("a", 0, 1000))
    tracker.remember("s2", SessionMemory("b", 0, 1000))
    assert tracker.migrate("a", "c", 3) == 1
    moved = tracker.get("s1")
    assert moved == SessionMemory("c", 3, 1000) and tracker.get("s2") == SessionMemory("b", 0, 1000)
    epochs = {"a": 0, "b": 0, "c": 3}
    # The restored cache serves the next turn: a hit, no lost prefix.
    assert classify(moved, "c", epochs, 1200, 1000, 1000, 1000).cause is None
    # Had it lost some there, it was lost on c, not by routing away from a.
    assert classify(moved, "c", epochs, 1200, 500, 1000, 1000).cause == "evicted"


def test_a_session_returns_once_a_turn_even_with_requests_in_parallel() -> None:
    """The first request after a turn's end measures the time away; a second request of
    the session sent before that turn's successor ends (parallel tool calls, subagents
    sharing the key) measures nothing."""
    tracker = SessionTracker()
    assert tracker.returning("s") is None  # never seen
    tracker.remember("s", SessionMemory("w0", 0, 100, ended_at=5.0, waiting_on="tool"))
    first = tracker.returning("s")
    assert first is not None and first.ended_at == 5.0 and first.waiting_on == "tool"
    assert tracker.returning("s") is None
    tracker.remember("s", SessionMemory("w0", 0, 200, ended_at=9.0))
    again = tracker.returning("s")
    assert again is not None and again.ended_at == 9.0
    tracker.remember("t", SessionMemory("w0", 0, 100))  # no end known
    assert tracker.returning("t") is None
