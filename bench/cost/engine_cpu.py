"""``kvrouter bench engine-cpu``: the simulated engine's own CPU per million simulated tokens.

One engine process, ``--clients`` closed-loop streaming clients (each a session whose
prompt grows by its last reply and some new text, so prefix hits happen as in a real
replay), a fixed number of requests. The engine process's CPU seconds (its threads' run
time from ``/proc/<pid>/task/*/schedstat``) are divided by the tokens it simulated:
prompt tokens it was sent plus tokens it generated. Repeated ``--repeat`` times; the median and the
range are printed. The lower the figure, the less a replay's results depend on how busy
the host's CPU is.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.sim.fleet import start_engine, stop, wait_healthy
from bench.textgen import text_for

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class CpuRun:
    cpu_s: float
    prompt_tokens: int
    generated_tokens: int

    @property
    def per_million_tokens(self) -> float:
        return self.cpu_s / (self.prompt_tokens + self.generated_tokens) * 1e6

    @property
    def per_million_generated(self) -> float:
        return self.cpu_s / max(self.generated_tokens, 1) * 1e6


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds of a live process (Linux ``/proc``): the nanoseconds its threads ran
    (``schedstat``), or where the kernel keeps none, user + system time in clock ticks
    (10 ms each, a tenth of a short run's figure)."""
    proc = Path(f"/proc/{pid}")
    try:
        return (
            sum(
                int((task / "schedstat").read_text().split()[0])
                for task in (proc / "task").iterdir()
            )
            / 1e9
        )
    except (OSError, ValueError, IndexError):
        fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


async def _session(
    http: aiohttp.ClientSession, url: str, name: str, turns: int, new_tokens: int, max_tokens: int
) -> tuple[int, int]:
    messages: list[dict[str, str]] = []
    prompt = generated = 0
    for turn in range(turns):
        messages.append({"role": "user", "content": text_for(f"{name}-{turn}", new_tokens)})
        body = {
            "model": "m",
            "messages": messages,
            "stream": True,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        reply: list[str] = []
        async with http.post(f"{url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                for choice in chunk.get("choices") or ():
                    reply.append(choice["delta"].get("content") or "")
                if chunk.get("usage"):
                    prompt += chunk["usage"]["prompt_tokens"]
                    generated += chunk["usage"]["completion_tokens"]
        messages.append({"role": "assistant", "content": "".join(reply)})
    return prompt, generated


async def measure(
    clients: int,
    turns: int,
    new_tokens: int,
    max_tokens: int,
    time_scale: float,
    port: int,
    kv_tokens: int,
    source: Path | None = None,
) -> CpuRun:
    flags = [
        "--time-scale",
        str(time_scale),
        "--kv-tokens",
        str(kv_tokens),
        "--served-model-name",
        "m",
    ]
    engine = await start_engine("0", "127.0.0.1", port, flags, source)
    try:
        await wait_healthy([engine.url])
        pid = engine.process.pid
        before = process_cpu_seconds(pid)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as http:
            counts = await asyncio.gather(
                *(
                    _session(http, engine.url, f"c{i}", turns, new_tokens, max_tokens)
                    for i in range(clients)
                )
            )
        cpu = process_cpu_seconds(pid) - before
    finally:
        await stop([engine])
    return CpuRun(cpu, sum(c[0] for c in counts), sum(c[1] for c in counts))


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):10.2f}  ({min(values):.2f}-{max(values):.2f})"


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser(
        "engine-cpu", help="the simulated engine's CPU per million tokens", description=__doc__
    )
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4, help="requests per client")
    parser.add_argument("--new-tokens", type=int, default=2000, help="new prompt tokens a turn")
    parser.add_argument("--max-tokens", type=int, default=400, help="generated tokens a turn")
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--kv-tokens", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--port", type=int, default=8190)
    parser.add_argument(
        "--engine-source",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="also measure the engine of this checkout (e.g. a `git worktree` "
        "of an older commit), interleaved with this one within each "
        "round; repeatable",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for source in args.engine_source:
        if not (source / "router" / "__init__.py").is_file():
            print(f"--engine-source {source}: no router package there", file=sys.stderr)
            return 2
    sources: list[Path | None] = [None, *args.engine_source]
    runs: dict[Path | None, list[CpuRun]] = {source: [] for source in sources}
    for _ in range(args.repeat):
        for source in sources:
            runs[source].append(
                asyncio.run(
                    measure(
                        args.clients,
                        args.turns,
                        args.new_tokens,
                        args.max_tokens,
                        args.time_scale,
                        args.port,
                        args.kv_tokens,
                        source,
                    )
                )
            )
    first = runs[None][0]
    print(
        f"engine CPU over {args.repeat} runs, median (min-max); "
        f"{first.prompt_tokens:,} prompt + {first.generated_tokens:,} generated tokens "
        f"a run, {args.clients} clients, time scale {args.time_scale:g}"
    )
    for source in sources:
        if len(sources) > 1:
            print(f"\nengine of {'this checkout' if source is None else source}")
        print(_report(runs[source], runs[None] if source is not None else None))
    sys.stdout.flush()
    return 0


def _report(runs: list[CpuRun], against: list[CpuRun] | None) -> str:
    lines = [
        f"CPU s per 1M simulated tokens   {_summary([r.per_million_tokens for r in runs])}",
        f"CPU s per 1M generated tokens   {_summary([r.per_million_generated for r in runs])}",
        f"CPU s a run                     {_summary([r.cpu_s for r in runs])}",
    ]
    if against is not None:
        # Round by round: the two engines ran back to back under the same conditions.
        ratios = [
            r.per_million_tokens / a.per_million_tokens
            for r, a in zip(runs, against, strict=True)
            if a.cpu_s > 0
        ]
        if ratios:
            lines.append(f"x this checkout's CPU          {_summary(ratios)}")
    return "\n".join(lines)
