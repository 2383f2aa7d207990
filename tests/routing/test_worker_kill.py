"""A simulated engine process killed under load (SIGKILL), then restarted."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from bench.ports import free_port_run
from bench.sim.fleet import fleet, start_engine, stop, wait_healthy
from router.config import HealthConfig, WorkerConfig
from tests.conftest import router_config, serve_router
from tests.router_client import chat_body, conversation, metric, parse_sse, wait_for

PROBES = HealthConfig(interval_s=0.2, timeout_s=0.5, scrape_interval_s=0.1, stale_after_s=2)
FLAGS = ["--kv-tokens", "50000", "--time-scale", "20", "--served-model-name", "sim-model"]


async def client(
    http: aiohttp.ClientSession, url: str, key: str, stop_at: float, outcomes: list[str]
) -> None:
    """Streams requests until ``stop_at``; records how each ended."""
    turn = 0
    while time.monotonic() < stop_at:
        body = chat_body(conversation(f"{key}-{turn}", 200, 50), max_tokens=40)
        try:
            async with http.post(url + "/v1/chat/completions", json=body) as response:
                raw = await response.read()
            if response.status != 200:
                outcomes.append(f"status {response.status}")
            else:
                _, usage, errors = parse_sse(raw)
                outcomes.append("error event" if errors else "ok" if usage else "cut")
        except aiohttp.ClientError as exc:
            outcomes.append(type(exc).__name__)
        turn += 1


async def test_a_killed_worker_costs_no_request_that_had_not_started() -> None:
    base = free_port_run(2)
    async with fleet(2, "127.0.0.1", base, FLAGS) as engines, aiohttp.ClientSession() as http:
        workers = tuple(WorkerConfig(e.url, name=f"w{i}") for i, e in enumerate(engines))
        config = router_config([], workers=workers, policy="round_robin", health=PROBES)
        async with serve_router(config) as router:
            state = router.state.router
            outcomes: list[str] = []
            stop_at = time.monotonic() + 3.0
            load = [
                asyncio.create_task(client(http, router.url, f"c{i}", stop_at, outcomes))
                for i in range(6)
            ]
            await asyncio.sleep(1.0)
            engines[0].kill()
            killed_at = time.monotonic()

            async def ejected() -> bool:
                return not state.fleet.workers["w0"].healthy

            await wait_for(ejected, timeout_s=PROBES.interval_s + PROBES.timeout_s + 1)
            eject_s = time.monotonic() - killed_at
            await asyncio.gather(*load)
            await engines[0].process.wait()

            # Only streams that were running on w0 when it died may fail, and they end
            # with an error event (the client never hangs); nothing else fails.
            failed = [o for o in outcomes if o != "ok"]
            assert set(failed) <= {"error event"}, failed
            assert len(failed) <= 6  # at most one stream per client was in flight
            assert len(outcomes) > 20
            assert eject_s <= PROBES.interval_s + PROBES.timeout_s + 0.5

            # Restarted on the same port: readmitted, and its old entries are gone.
            before = state.index.resident_blocks("w0")
            restarted = await start_engine("0", "127.0.0.1", engines[0].port, FLAGS)
            try:
                await wait_healthy([engines[0].url])

                async def readmitted_and_purged() -> bool:
                    return (
                        state.fleet.workers["w0"].healthy and state.index.resident_blocks("w0") == 0
                    )

                await wait_for(readmitted_and_purged, timeout_s=3)
                assert before > 0  # it held entries while it was down (a blip keeps them)
                assert (
                    await metric(http, router, "kvrouter_worker_restarts_total", worker="w0") == 1
                )
            finally:
                await stop([restarted])
