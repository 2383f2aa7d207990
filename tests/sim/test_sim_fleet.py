"""``kvrouter sim fleet``: real engine processes on their own ports."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import aiohttp

from bench.ports import free_port_run
from bench.sim.fleet import KVEventPorts, describe_line, fleet, wait_healthy
from bench.textgen import text_for
from router.index import events as wire
from tests.sim.test_sim_kv_events import replay_from, stand_in_ids, stored_ids


async def test_fleet_engines_are_separate_processes_with_separate_caches() -> None:
    base = free_port_run(2)
    flags = ["--kv-tokens", "20000", "--time-scale", "50", "--served-model-name", "m"]
    async with fleet(2, "127.0.0.1", base, flags) as engines, aiohttp.ClientSession() as http:
        assert [e.url for e in engines] == [
            f"http://127.0.0.1:{base}",
            f"http://127.0.0.1:{base + 1}",
        ]
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi " * 200}],
            "max_tokens": 2,
        }
        cached = []
        for url in (engines[0].url, engines[0].url, engines[1].url):
            async with http.post(f"{url}/v1/chat/completions", json=body) as response:
                assert response.status == 200
                usage = (await response.json())["usage"]
                cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0

        engines[0].kill()
        assert await asyncio.wait_for(engines[0].process.wait(), 5) == -signal.SIGKILL
        await wait_healthy([engines[1].url], timeout_s=5)


async def test_fleet_command_starts_and_stops_on_sigterm() -> None:
    base = free_port_run(6)  # two engines, then two port pairs for their KV events
    kv = base + 2
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.cli",
        "sim",
        "fleet",
        "--n",
        "2",
        "--base-port",
        str(base),
        "--kv-tokens",
        "20000",
        "--kv-events-port",
        str(kv),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        lines: list[str] = []
        while not lines or lines[-1] != "fleet ready; Ctrl-C stops it":
            line = await asyncio.wait_for(process.stdout.readline(), 30)
            assert line, "the fleet exited before it was ready"
            lines.append(line.decode().strip())
        assert (
            f"engine 1: http://127.0.0.1:{base + 1} kv_events_endpoint=tcp://127.0.0.1:{kv + 2}"
            f" kv_events_replay_endpoint=tcp://127.0.0.1:{kv + 3}"
        ) in lines
        async with aiohttp.ClientSession() as http:
            for port in (base, base + 1):
                async with http.get(f"http://127.0.0.1:{port}/v1/models") as response:
                    assert (await response.json())["data"][0]["id"] == "llama-3.1-8b"
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 15) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_fleet_engines_publish_kv_events_on_ports_of_their_own() -> None:
    base = free_port_run(6)  # two engines, then two port pairs
    kv = base + 2
    flags = ["--kv-tokens", "20000", "--time-scale", "50", "--served-model-name", "m"]
    async with (
        fleet(2, "127.0.0.1", base, flags, kv_events=KVEventPorts(kv)) as engines,
        aiohttp.ClientSession() as http,
    ):
        assert [e.describe() for e in engines] == [
            {
                "engine_id": str(i),
                "url": f"http://127.0.0.1:{base + i}",
                "kv_events_endpoint": f"tcp://127.0.0.1:{kv + 2 * i}",
                "kv_events_replay_endpoint": f"tcp://127.0.0.1:{kv + 2 * i + 1}",
            }
            for i in range(2)
        ]
        assert describe_line(engines[1]) == (
            f"engine 1: http://127.0.0.1:{base + 1} kv_events_endpoint=tcp://127.0.0.1:{kv + 2}"
            f" kv_events_replay_endpoint=tcp://127.0.0.1:{kv + 3}"
        )

        async def complete(engine: int, key: str) -> None:
            body = {"model": "m", "prompt": text_for(key, 40), "max_tokens": 1}
            async with http.post(f"{engines[engine].url}/v1/completions", json=body) as r:
                assert r.status == 200

        async def replayed(engine: int) -> list[wire.Message]:
            return await asyncio.to_thread(replay_from, kv + 2 * engine + 1, 0)

        await complete(0, "zero")
        await complete(1, "one")
        assert stored_ids(await replayed(0)) == stand_in_ids(text_for("zero", 40))[:32]
        assert stored_ids(await replayed(1)) == stand_in_ids(text_for("one", 40))[:32]

        # A restarted engine process publishes anew: sequence 0, only what followed.
        async with http.post(f"{engines[0].url}/sim/restart") as r:
            assert r.status == 200
        await complete(0, "again")
        again = await replayed(0)
        assert [m.seq for m in again] == [0]
        assert stored_ids(again) == stand_in_ids(text_for("again", 40))[:32]
        assert [m.seq for m in await replayed(1)] == [0]
