"""``kvrouter bench throughput --profile DIR``: kvrouter under the throughput load, sampled
by ``py-spy record`` (``pip install py-spy``), once per policy and variant.

py-spy runs with ``--nonblocking`` (it reads the process's memory without stopping it,
so the router runs at full speed, at the price of an occasional torn stack) and leaves
idle threads out: the shares are of the samples in which the router was busy. Its own
CPU is on the same two cores, so the request rate while profiling is lower than in the
measured rounds. Raw stacks go to ``DIR/<policy>.<variant>.txt``; the summary (own and
inclusive time per function, own time per file) is printed and written beside them.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from rich.console import Console

from bench import proc_cpu
from bench.throughput import loadgen
from bench.throughput.loadgen import RequestShape
from bench.throughput.pyspy import format_profile, summarize
from bench.throughput.run import ThroughputConfig, serving, standin_command, started, targets

SAMPLE_RATE = 250  # per second


def pyspy_command(pid: int, duration_s: float, output: Path) -> tuple[str, ...]:
    binary = shutil.which("py-spy")
    if binary is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy)")
    return (
        binary,
        "record",
        "--pid",
        str(pid),
        "--rate",
        str(SAMPLE_RATE),
        "--duration",
        str(max(1, round(duration_s))),
        "--format",
        "raw",
        "--nonblocking",
        "--output",
        str(output),
    )


async def profile_kvrouter(config: ThroughputConfig, out: Path, console: Console) -> None:
    """``out`` and ``config.out`` must exist."""
    ours = [t for t in targets(config) if t.router == "kvrouter"]
    async with started(standin_command(config), config.out / "standin.log"):
        for target in ours:
            async with serving(target, config) as pids:
                url = f"http://{config.host}:{target.port}"
                for variant in config.variants:
                    shape = RequestShape(stream=variant == "stream")
                    await loadgen.run_load(
                        config.generator, url, shape, config.connections, config.warmup_s
                    )
                    raw = out / f"{target.policy}.{variant}.txt"
                    spy = await asyncio.create_subprocess_exec(
                        *pyspy_command(pids[0], config.duration_s, raw),
                        stdout=asyncio.subprocess.DEVNULL,
                        stderr=asyncio.subprocess.DEVNULL,
                    )
                    before = proc_cpu.sample(pids)
                    load = await loadgen.run_load(
                        config.generator, url, shape, config.connections, config.duration_s
                    )
                    cpu_us = proc_cpu.sample(pids).since(before) / max(load.requests, 1) * 1e6
                    await spy.wait()
                    summary = format_profile(summarize(raw.read_text().splitlines()))
                    heading = (
                        f"kvrouter {target.policy}, {variant} replies, under py-spy: "
                        f"{load.rate:,.0f} req/s, {cpu_us:.0f} µs CPU/request"
                    )
                    (out / f"{target.policy}.{variant}.summary.txt").write_text(
                        f"{heading}\n{summary}\n"
                    )
                    console.print(heading)
                    console.print(summary, markup=False, highlight=False)
