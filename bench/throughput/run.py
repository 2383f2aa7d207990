"""``kvrouter bench throughput``: requests per second and router CPU per request, with
engines that cost nothing.

Stand-in engines (``bench/throughput/standin.py``: one process, one port per worker) answer every
completion at once with a fixed reply, so what is measured is the router: a closed loop
of ``--connections`` keep-alive connections (``wrk``, else a Python client) sends short
chat requests (a shared 600-byte system prompt, a user message unique to each request)
through kvrouter (``round_robin`` and ``cache_aware``; with ``--kvrouter-processes 1,2`` also
as ``kvrouter serve --processes 2``, the rows ``kvrouter round_robin ×2``: the supervisor,
its processes and their Valkey all count as the router's CPU) and, with ``--peer-bin``, through
SMG (``smg launch``) and vllm-router with ``--policy round_robin`` and ``cache_aware``,
each with the flags ``bench peers`` gives it. ``direct`` is the same load sent straight
to one stand-in: the ceiling the harness allows on this machine.

Each round starts every router in turn (the order rotated from round to round), and for
each variant (whole replies, then streamed ones) warms it up and measures it. Figures
are ``median (min-max)`` over the rounds: requests/s, latency p50 and p99 as the load
generator saw them, and CPU per request: the router's (its process and any children,
from ``/proc/<pid>/task/*/schedstat``) and the stand-ins'. A router that answers errors
fast would look fast: the error count is printed beside the figures.

The peers run only inside a loopback-only network namespace (they may reach for a model
hub when they start); the command refuses to start them anywhere else::

    unshare -n bash -c 'ip link set lo up; kvrouter bench throughput --peer-bin /opt/peers/bin'

Last, the cost of one 100K-token prompt through kvrouter's parse, hash and lookup path,
timed in this process (``bench/cost/prompt.py``). ``--profile DIR`` measures nothing of
that: it runs kvrouter under the same load once per policy and variant with ``py-spy
record`` attached and prints where its CPU goes (``bench/throughput/profile.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from rich.console import Console

from bench import netns, proc_cpu
from bench.compare.demo import QUEUE_SUFFIX, DemoConfig, kvrouter_command, stop_process
from bench.compare.peers import smg_command, vllm_router_command
from bench.cost.prompt import prompt_cost
from bench.replay.rounds import rotated
from bench.throughput import loadgen
from bench.throughput.loadgen import Generator, RequestShape
from bench.throughput.report import Run, Variant, prompt_cost_table, runs_table, save

DEFAULT_CONNECTIONS = 64
DEFAULT_WARMUP_S = 3.0
DEFAULT_DURATION_S = 10.0
DEFAULT_ROUNDS = 3
DEFAULT_ENGINES = 4
DEFAULT_POLICIES = ("round_robin", "cache_aware")
DEFAULT_VARIANTS: tuple[Variant, ...] = ("whole", "stream")
DEFAULT_OUT = Path("results/throughput")
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class ThroughputConfig:
    connections: int = DEFAULT_CONNECTIONS
    warmup_s: float = DEFAULT_WARMUP_S
    duration_s: float = DEFAULT_DURATION_S
    rounds: int = DEFAULT_ROUNDS
    engines: int = DEFAULT_ENGINES
    policies: tuple[str, ...] = DEFAULT_POLICIES
    kvrouter_processes: tuple[int, ...] = (1,)  # one kvrouter target per count
    variants: tuple[Variant, ...] = DEFAULT_VARIANTS
    peer_bin: Path | None = None
    generator: Generator = "wrk"
    direct: bool = True
    host: str = "127.0.0.1"
    router_port: int = 8000
    base_port: int = 8100
    out: Path = DEFAULT_OUT
    prompt_tokens: int = 100_000
    prompt_repeat: int = 30
    # Another checkout of this repository whose kvrouter is measured beside this one's.
    checkout: Path | None = None

    def __post_init__(self) -> None:
        if self.connections < 1 or self.rounds < 1 or self.engines < 1:
            raise ValueError("connections, rounds and engines must be at least 1")
        if not self.kvrouter_processes or min(self.kvrouter_processes) < 1:
            raise ValueError("--kvrouter-processes: counts of at least 1")
        if self.duration_s <= 0 or self.warmup_s < 0:
            raise ValueError("duration must be > 0 and warm-up >= 0")

    @property
    def engine_ports(self) -> list[int]:
        return [self.base_port + i for i in range(self.engines)]

    @property
    def engine_urls(self) -> list[str]:
        return [f"http://{self.host}:{port}" for port in self.engine_ports]


@dataclass(frozen=True, slots=True)
class Target:
    """What the load is sent to: a router command listening on ``port``, or (no
    command) the first stand-in directly."""

    router: str
    policy: str
    command: tuple[str, ...] | None
    port: int
    processes: int = 1  # kvrouter serve --processes
    env: tuple[tuple[str, str], ...] = ()  # set for the command, over this process's

    @property
    def label(self) -> str:
        label = f"{self.router} {self.policy}".strip()
        return label if self.processes == 1 else f"{label} ×{self.processes}"


def with_policy(command: Sequence[str], policy: str) -> tuple[str, ...]:
    """``command`` with the value after ``--policy`` replaced."""
    argv = list(command)
    argv[argv.index("--policy") + 1] = policy
    return tuple(argv)


def targets(config: ThroughputConfig) -> list[Target]:
    urls, port = config.engine_urls, config.router_port
    demo = DemoConfig(host=config.host, router_port=port)
    found = [Target("direct", "", None, config.base_port)] if config.direct else []
    for policy in config.policies:
        for n in config.kvrouter_processes:
            extra = ("--processes", str(n)) if n > 1 else ()
            command = kvrouter_command(demo, policy, urls, port, *extra)
            found.append(Target("kvrouter", policy, command, port, n))
            if config.checkout is not None:
                # Its router/ and policies/ first on the path (and not the working
                # directory, which -m would put before it): its code, this Python.
                env = (("PYTHONPATH", str(config.checkout.resolve())), ("PYTHONSAFEPATH", "1"))
                name = f"kvrouter@{config.checkout.name}"
                found.append(Target(name, policy, command, port, n, env))
    if config.peer_bin is None:
        return found
    smg, vllm = config.peer_bin / "smg", config.peer_bin / "vllm-router"
    for policy in config.policies:
        if smg.exists():
            command = smg_command(smg, demo, urls, port, port + 1000)
            found.append(Target("smg", policy, with_policy(command, policy), port))
        if vllm.exists():
            command = vllm_router_command(vllm, demo, urls, port, port + 1001)
            found.append(Target("vllm-router", policy, with_policy(command, policy), port))
    return found


async def wait_routing(url: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until a completion through ``url`` answers 200 three times in a row: a router's
    /health can pass before it has taken its workers in."""
    body = RequestShape(stream=False).body("ready")
    headers = {"Content-Type": "application/json"}
    deadline = asyncio.get_running_loop().time() + timeout_s
    ok = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while ok < 3:
            try:
                async with http.post(url + loadgen.PATH, data=body, headers=headers) as reply:
                    await reply.read()
                    ok = ok + 1 if reply.status == 200 else 0
            except (aiohttp.ClientError, TimeoutError):
                ok = 0
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"nothing routed through {url} after {timeout_s:g} s")
            if ok < 3:
                await asyncio.sleep(0.1)


async def wait_processes(url: str, count: int, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until every process of a ``--processes`` kvrouter answers its /metrics: one that
    is not yet listening would leave the load's connections to the others."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url + "/metrics") as reply:
                    text = await reply.text()
                up = [ln for ln in text.splitlines() if ln.startswith("kvrouter_process_up{")]
                if len(up) == count and all(ln.endswith(" 1.0") for ln in up):
                    return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"not every process of {url} serves after {timeout_s:g} s")
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def started(
    command: Sequence[str], log_path: Path, env: Sequence[tuple[str, str]] = ()
) -> AsyncIterator[int]:
    """``command`` running (``env`` over this process's), its output in ``log_path``;
    yields its pid."""
    environ = {**os.environ, **dict(env)} if env else None
    with log_path.open("ab") as log:
        process = await asyncio.create_subprocess_exec(
            *command, stdout=log, stderr=log, env=environ
        )
        try:
            yield process.pid
        finally:
            await stop_process(process, STOP_TIMEOUT_S)


@contextlib.asynccontextmanager
async def serving(target: Target, config: ThroughputConfig) -> AsyncIterator[list[int]]:
    """``target`` routing; yields the pids whose CPU is the router's (none for direct)."""
    url = f"http://{config.host}:{target.port}"
    if target.command is None:
        await wait_routing(url)
        yield []
        return
    log_path = config.out / f"{target.label.replace(' ', '-').replace('×', 'x')}.log"
    async with started(target.command, log_path, target.env) as pid:
        try:
            await wait_routing(url)
            if target.processes > 1:
                await wait_processes(url, target.processes)
        except TimeoutError as exc:
            raise RuntimeError(f"{target.label} did not start routing: see {log_path}") from exc
        yield [pid]


async def measure(
    target: Target,
    variant: Variant,
    round_index: int,
    pids: Sequence[int],
    standin_pid: int,
    config: ThroughputConfig,
) -> Run:
    url = f"http://{config.host}:{target.port}"
    shape = RequestShape(stream=variant == "stream")
    if config.warmup_s > 0:
        await loadgen.run_load(config.generator, url, shape, config.connections, config.warmup_s)
    stats_url = config.engine_urls[0] + "/standin/stats"
    posts_before = await engine_posts(stats_url)
    router_before, standin_before = proc_cpu.sample(pids), proc_cpu.sample([standin_pid])
    load = await loadgen.run_load(
        config.generator, url, shape, config.connections, config.duration_s
    )
    router_after = proc_cpu.sample(pids)
    standin_cpu = proc_cpu.sample([standin_pid]).since(standin_before)
    posts = await engine_posts(stats_url) - posts_before
    return Run(
        target.label, variant, round_index, load, router_after.since(router_before),
        standin_cpu, posts, router_after.system_share_since(router_before),
    )  # fmt: skip


async def engine_posts(stats_url: str) -> int:
    """POST requests the stand-ins (all ports of the process) have answered so far."""
    async with aiohttp.ClientSession() as http, http.get(stats_url) as reply:
        counts: dict[str, int] = await reply.json()
    return sum(n for key, n in counts.items() if key.startswith("POST "))


def standin_command(config: ThroughputConfig) -> tuple[str, ...]:
    ports = ",".join(str(p) for p in config.engine_ports)
    return (
        sys.executable,
        "-m",
        "bench.throughput.standin",
        "--host",
        config.host,
        "--ports",
        ports,
    )


async def run_rounds(config: ThroughputConfig, console: Console) -> list[Run]:
    """Every target, every variant, ``config.rounds`` times; ``config.out`` must exist
    (the routers' logs go there)."""
    found = targets(config)
    runs: list[Run] = []
    async with started(standin_command(config), config.out / "standin.log") as standin_pid:
        for round_index in range(config.rounds):
            for target in rotated(found, round_index):
                async with serving(target, config) as pids:
                    for variant in config.variants:
                        run = await measure(target, variant, round_index, pids, standin_pid, config)
                        runs.append(run)
                        console.print(
                            f"round {round_index + 1}/{config.rounds} {target.label:24} "
                            f"{variant:6} {run.load.rate:9,.0f} req/s  p50 "
                            f"{run.load.p50_s * 1e3:6.2f} ms  p99 {run.load.p99_s * 1e3:6.2f} ms"
                            f"  router {run.router_us:6.0f} µs/req  errors {run.load.errors}"
                        )
    return runs


def policies_of(labels: Sequence[str]) -> list[str]:
    """The policies behind kvrouter labels, once each (``ttft+queue`` is ``ttft``: the
    prompt's cost is the policy's)."""
    return list(dict.fromkeys(label.partition(QUEUE_SUFFIX)[0] for label in labels))


async def run_benchmark(config: ThroughputConfig, console: Console) -> list[Run]:
    """The rounds, their tables and the prompt cost; refuses peers outside a
    loopback-only namespace before anything starts."""
    if config.peer_bin is not None:
        netns.require_loopback_only()
    runs = await run_rounds(config, console)
    for variant in config.variants:
        console.print(runs_table(runs, variant))
    costs = [
        prompt_cost(p, config.prompt_tokens, config.engines, config.prompt_repeat)
        for p in policies_of(config.policies)
    ]
    console.print(prompt_cost_table(costs))
    save(runs, costs, config.out / "throughput.json")
    return runs
