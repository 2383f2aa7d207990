"""A worker fails; its engine's checkpoint comes back on a new engine, which the router is
told of (add, then migrate): the sessions that lived on the failed worker hit on their
next turn, the turn outcomes say so and no lost prefix is counted. Without the migrate,
the new engine's cache is there but the router does not know it is. Real HTTP over
loopback to simulated engines restored from a real checkpoint file."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import aiohttp

from bench.textgen import text_for
from tests.conftest import EngineFactory, RunningRouter, router_config, serve_router
from tests.router_client import BLOCK, Streamed, chat_body, conversation, metric, post

TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SESSIONS = 6
REPLY_TOKENS = 16


async def call(http: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> Any:
    async with http.request(method, url, json=body, headers=AUTH) as response:
        assert response.status in (200, 201), await response.text()
        return await response.json()


async def turn(
    http: aiohttp.ClientSession, router: RunningRouter, history: list[dict[str, Any]], key: str
) -> Streamed:
    result = await post(http, router.url, chat_body(history, REPLY_TOKENS, user=key))
    assert result.status == 200 and not result.errors
    history += [
        {"role": "assistant", "content": result.text},
        {"role": "user", "content": text_for(f"{key}-next{len(history)}", 60)},
    ]
    return result


async def sessions_then_failure(
    engine_factory: EngineFactory, tmp_path: Path, migrate: bool
) -> tuple[dict[str, Streamed], dict[str, Streamed], str, dict[str, float]]:
    """Each session's turn before the failure and after it; the failed worker's name;
    the router's turn and lost-prefix counters after it."""
    checkpoint = tmp_path / "w0.ckpt"
    async with contextlib.AsyncExitStack() as stack:
        fleet = [
            await stack.enter_async_context(engine_factory(engine_id=str(i))) for i in range(3)
        ]
        router = await stack.enter_async_context(
            serve_router(router_config(fleet, admin_token=TOKEN, policy="ttft"))
        )
        http = await stack.enter_async_context(aiohttp.ClientSession())
        histories = {f"s{i}": conversation(f"rm{i}", 400, 80) for i in range(SESSIONS)}
        before = {key: await turn(http, router, h, key) for key, h in histories.items()}
        failed = before["s0"].worker
        assert failed is not None
        source = fleet[int(failed[1:])]
        await call(http, "POST", f"{source.url}/sim/checkpoint", {"path": str(checkpoint)})
        await call(http, "POST", f"{router.url}/admin/workers/{failed}/drain")  # it dies
        restored = await stack.enter_async_context(
            engine_factory(engine_id="9", restore=str(checkpoint))
        )
        await call(http, "POST", f"{router.url}/admin/workers", {"url": restored.url, "name": "r"})
        if migrate:
            moved = await call(
                http, "POST", f"{router.url}/admin/workers/{failed}/migrate", {"to": "r"}
            )
            assert moved["moved_tokens"] > 0
        await call(http, "DELETE", f"{router.url}/admin/workers/{failed}")
        after = {key: await turn(http, router, h, key) for key, h in histories.items()}
        counts = {
            "hit": await metric(http, router, "kvrouter_turns_total", outcome="hit"),
            "predicted_on_r": await metric(
                http, router, "kvrouter_predicted_cached_tokens_total", worker="r"
            ),
            "lost": sum(
                [
                    await metric(http, router, "kvrouter_lost_prefix_turns_total", cause=cause)
                    for cause in ("worker_failed", "routed_elsewhere", "evicted", "unknown")
                ]
            ),
        }
    return before, after, failed, counts


async def test_a_restored_checkpoint_with_migrate_keeps_the_failed_workers_sessions_hitting(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    before, after, failed, counts = await sessions_then_failure(engine_factory, tmp_path, True)
    moved = [key for key, result in before.items() if result.worker == failed]
    assert moved, "no session lived on the failed worker"
    for key in moved:
        computed = before[key].usage["prompt_tokens"] + REPLY_TOKENS - 1  # type: ignore[index]
        assert after[key].worker == "r"
        assert after[key].cached == computed // BLOCK * BLOCK > 0
    assert counts["lost"] == 0
    assert counts["hit"] == SESSIONS  # every session's second turn
    # The router knew: it predicted the restored cache it sent them to (to within its
    # text blocks, 64 tokens each, against the engine's 16).
    assert counts["predicted_on_r"] >= sum(after[key].cached - 2 * 64 for key in moved) > 0


async def test_without_the_migrate_the_router_does_not_know_what_the_restore_kept(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    """The control: the same failure and restore, no migrate. Here the new worker, idle,
    is where load alone puts the failed worker's sessions, so the engine's cache serves
    them all the same; but the router expected nothing there, and with any load on the
    new worker it would have sent them elsewhere by that expectation."""
    before, after, failed, counts = await sessions_then_failure(engine_factory, tmp_path, False)
    moved = [key for key, result in before.items() if result.worker == failed]
    assert moved and all(after[key].worker == "r" and after[key].cached > 0 for key in moved)
    assert counts["predicted_on_r"] == 0


async def test_migrating_onto_a_worker_restored_in_place_survives_its_restart_being_seen(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    """The checkpoint is restored onto another worker's engine (a new process there, its
    old cache gone) and migrate is called at once, before the router's scrape has seen
    that restart. The restart must be acted on first: seen later, its purge would take
    the migrated entries with it."""
    checkpoint = tmp_path / "src.ckpt"
    async with (
        engine_factory(engine_id="0") as e0,
        engine_factory(engine_id="1") as e1,
        serve_router(router_config([e0, e1], admin_token=TOKEN, policy="ttft")) as router,
        aiohttp.ClientSession() as http,
    ):
        history = conversation("inplace", 400, 80)
        first = await turn(http, router, history, "inplace")
        source = first.worker
        target = "w1" if source == "w0" else "w0"
        source_url, target_url = (e0.url, e1.url) if source == "w0" else (e1.url, e0.url)
        await call(http, "POST", f"{source_url}/sim/checkpoint", {"path": str(checkpoint)})
        await call(http, "POST", f"{target_url}/sim/restore", {"path": str(checkpoint)})
        await call(http, "POST", f"{router.url}/admin/workers/{source}/migrate", {"to": target})
        await router.state.prober.scrape_all()  # the scrape after the migrate
        await call(http, "DELETE", f"{router.url}/admin/workers/{source}")
        after = await turn(http, router, history, "inplace")
        predicted = await metric(
            http, router, "kvrouter_predicted_cached_tokens_total", worker=target
        )
    assert after.worker == target and after.cached > 0
    assert predicted > 0


async def predicted_after_a_late_checkpoint(
    engine_factory: EngineFactory, tmp_path: Path, with_time: bool
) -> tuple[float, int]:
    """A session takes a turn after its worker's checkpoint; the worker fails and the
    checkpoint is restored and migrated to. Returns what the router predicted cached on
    the restored worker for the session's next turn, and what the engine reported."""
    checkpoint = tmp_path / "late.ckpt"
    async with (
        engine_factory(engine_id="0") as e0,
        serve_router(router_config([e0], admin_token=TOKEN, policy="ttft")) as router,
        aiohttp.ClientSession() as http,
    ):
        history = conversation("late", 400, 80)
        await turn(http, router, history, "late")
        taken = await call(http, "POST", f"{e0.url}/sim/checkpoint", {"path": str(checkpoint)})
        history[-1]["content"] = text_for("late-long", 400)  # a long tool result
        await turn(http, router, history, "late")  # computed after the checkpoint
        async with engine_factory(engine_id="9", restore=str(checkpoint)) as restored:
            await call(
                http, "POST", f"{router.url}/admin/workers", {"url": restored.url, "name": "r"}
            )
            body: dict[str, Any] = {"to": "r"}
            if with_time:
                body["checkpoint_taken_at"] = taken["taken_at"]
            await call(http, "POST", f"{router.url}/admin/workers/w0/migrate", body)
            await call(http, "DELETE", f"{router.url}/admin/workers/w0")
            after = await turn(http, router, history, "late")
            predicted = await metric(
                http, router, "kvrouter_predicted_cached_tokens_total", worker="r"
            )
    assert after.worker == "r"
    return predicted, after.cached


async def test_migrating_with_the_checkpoints_time_promises_only_what_it_holds(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    """To within one of the router's text blocks (64 tokens by its estimate)."""
    text_block = 64
    predicted, cached = await predicted_after_a_late_checkpoint(engine_factory, tmp_path, True)
    assert 0 < predicted <= cached + text_block
    # Without the time, everything the worker computed after the checkpoint is promised.
    late, cached_again = await predicted_after_a_late_checkpoint(engine_factory, tmp_path, False)
    assert cached_again == cached
    assert late > cached + 4 * text_block
