"""``kvrouter bench kill``: SIGKILL one engine under load, then restart it.

Reports requests lost (by how they ended), TTFT p50/p99 before the kill against the
seconds after it (a ratio in the same run), the time until the router stopped sending to
the dead worker, and the time from the restarted engine answering /health to the router
sending to it again.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import Counter
from typing import Any

import aiohttp

from bench.sim.fleet import fleet, start_engine, stop, wait_healthy
from bench.textgen import text_for
from router.config import HealthConfig, RouterConfig, WorkerConfig
from router.server import serving

FLAGS = ["--kv-tokens", "50000", "--time-scale", "10", "--served-model-name", "m"]


async def _client(
    http: aiohttp.ClientSession,
    url: str,
    key: str,
    stop_at: float,
    records: list[tuple[float, float | None, str]],
) -> None:
    turn = 0
    while time.monotonic() < stop_at:
        body = {
            "model": "m",
            "stream": True,
            "max_tokens": 32,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": text_for(f"{key}{turn}", 300)}],
        }
        start, first, outcome = time.monotonic(), None, "ok"
        try:
            async with http.post(url + "/v1/chat/completions", json=body) as response:
                if response.status != 200:
                    outcome = f"HTTP {response.status}"
                async for chunk in response.content.iter_any():
                    first = first or time.monotonic()
                    if b'"error"' in chunk:
                        outcome = "error event (stream in flight)"
        except aiohttp.ClientError as exc:
            outcome = type(exc).__name__
        records.append((start, None if first is None else first - start, outcome))
        turn += 1


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def run_kill(clients: int, before_s: float, after_s: float, base_port: int) -> dict[str, Any]:
    probes = HealthConfig(interval_s=1.0, timeout_s=1.0)
    async with fleet(2, "127.0.0.1", base_port, FLAGS) as engines:
        workers = tuple(WorkerConfig(e.url, name=f"w{i}") for i, e in enumerate(engines))
        config = RouterConfig(workers=workers, policy="least_load", health=probes)
        async with (
            serving(config) as (server, url),
            aiohttp.ClientSession() as http,
        ):
            fleet_state = server.state.router.fleet
            records: list[tuple[float, float | None, str]] = []
            stop_at = time.monotonic() + before_s + after_s
            load = [
                asyncio.create_task(_client(http, url, f"c{i}-", stop_at, records))
                for i in range(clients)
            ]
            await asyncio.sleep(before_s)
            engines[0].kill()
            killed = time.monotonic()
            # The router exposes no event for this; 10 ms polling is the measurement step.
            while fleet_state.workers["w0"].healthy:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            eject_s = time.monotonic() - killed
            await asyncio.gather(*load)
            await engines[0].process.wait()
            restarted = await start_engine("0", "127.0.0.1", engines[0].port, FLAGS)
            try:
                await wait_healthy([engines[0].url])
                up = time.monotonic()
                while not fleet_state.workers["w0"].healthy:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
                readmit_s = time.monotonic() - up
            finally:
                await stop([restarted])
    before = [t for s, t, o in records if s < killed and t is not None]
    after = [t for s, t, o in records if s >= killed and t is not None]
    return {
        "requests": len(records),
        "outcomes": dict(Counter(o for _, _, o in records)),
        "ttft_ms_p50_before": _p(before, 0.5),
        "ttft_ms_p99_before": _p(before, 0.99),
        "ttft_ms_p50_after_kill": _p(after, 0.5),
        "ttft_ms_p99_after_kill": _p(after, 0.99),
        "ttft_p99_ratio_after_over_before": _p(after, 0.99) / _p(before, 0.99),
        "eject_s": eject_s,
        "probe_interval_s": probes.interval_s,
        "readmit_s": readmit_s,
        "median_ttft_ms": statistics.median(before + after) * 1000,
    }


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser("kill", help="kill one engine under load; losses, eject time")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--before", type=float, default=5.0, help="seconds of load first")
    parser.add_argument("--after", type=float, default=5.0, help="seconds after the kill")
    parser.add_argument("--base-port", type=int, default=8150)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(run_kill(args.clients, args.before, args.after, args.base_port))
    for key, value in result.items():
        print(f"{key:36} {value:.3f}" if isinstance(value, float) else f"{key:36} {value}")
    return 0
