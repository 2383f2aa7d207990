"""``kvrouter sim fleet``: real engine processes on their own ports."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys

import aiohttp

from bench.sim.fleet import fleet, wait_healthy


def free_port_run(n: int) -> int:
    """A base port with ``n`` consecutive free ports after it."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n >= 65535:
            continue
        try:
            for port in range(base, base + n):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no run of free ports")


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
    base = free_port_run(2)
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
        assert f"engine 1: http://127.0.0.1:{base + 1}" in lines
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
