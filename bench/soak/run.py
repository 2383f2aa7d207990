"""``kvrouter bench soak``: a long run of mixed traffic through a real router while its
workers restart, hang, fail and are drained, removed and added back.

``kvrouter serve`` runs as its own process (so its RSS and descriptors are its own) in
front of ``--engines`` simulated vLLM engines (processes, time scale ``--time-scale``).
``--clients`` closed-loop clients send multi-turn chat and completion sessions, streamed
and not, some abandoned mid-stream (``bench/soak/traffic.py``); one fault at a time hits
one worker every ``--fault-every`` seconds, and every ``--outage-every`` seconds every
engine is killed at once (``bench/soak/faults.py``). The router's RSS, open descriptors
and asyncio tasks are sampled throughout (``bench/soak/sample.py``).

The run passes when no request was lost before its first byte while a worker could
serve it, the RSS at the end is within 5% of the RSS at the end of ``--warmup``, the
descriptor and task counts do not grow, and the router's load is back to zero once the
traffic stops (``bench/soak/report.py``). Everything goes to ``--out``: ``soak.json``,
``records.jsonl`` (one line per request), ``router.log`` and ``engines.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from rich.console import Console

from bench.compare.demo import DemoConfig, kvrouter_command, stop_process
from bench.ports import first_taken
from bench.sim.fleet import wait_healthy
from bench.soak.faults import FAULT_KINDS, FaultEvent, FaultPlan, SoakFleet, run_faults
from bench.soak.report import (
    Limits,
    faults_summary,
    judge_process,
    judge_requests,
    print_summary,
    read_log,
    save,
)
from bench.soak.sample import Sample, sample_until, scrape, take, total
from bench.soak.traffic import Record, TrafficConfig, client, open_http
from router.config import DEFAULT_POLICY

MODEL = "soak-model"
DEFAULT_DURATION_S = 1800.0
DEFAULT_OUT = Path("results/soak")
DEFAULT_BASE_PORT = 8710
DEFAULT_ROUTER_PORT = 8709
# The router's timeouts for engines --time-scale times faster than real ones (its
# defaults are for real prefills of minutes): a hung worker's streams are retried after
# 4 s without a byte, a silent one is given up after 6 s, probes run every second.
ROUTER_SETTINGS: dict[str, Any] = {
    "health": {"interval_s": 1.0, "timeout_s": 1.0, "scrape_interval_s": 1.0, "stale_after_s": 5.0},
    "upstream": {"first_byte_timeout_s": 4.0, "read_timeout_s": 6.0},
}
SETTLE_S = 3.0  # idle before the first sample, so the probes' connections are pooled
# The sampler's one connection outlives any pause between samples (aiohttp's default,
# 15 s, would close it between two and leave it out of one count).
SAMPLER_KEEPALIVE_S = 3600.0
IDLE_TIMEOUT_S = 45.0  # for the router to close what the load left open (pools: 15 s)
RATE_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class SoakConfig:
    duration_s: float = DEFAULT_DURATION_S
    warmup_s: float | None = None  # default: a sixth of the duration
    engines: int = 4
    clients: int = 8
    think_s: float = 0.5
    seed: int = 7
    out: Path = DEFAULT_OUT
    time_scale: float = 10.0
    kv_tokens: int = 60_000
    base_port: int = DEFAULT_BASE_PORT
    router_port: int = DEFAULT_ROUTER_PORT
    host: str = "127.0.0.1"
    sample_every_s: float = 5.0
    max_attempts: int = 2  # the router's: workers tried before the first byte
    policy: str = DEFAULT_POLICY
    faults: FaultPlan = field(default_factory=FaultPlan)

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.engines < 1 or self.clients < 1:
            raise ValueError("duration, engines and clients must be positive")

    @property
    def warmup(self) -> float:
        return self.duration_s / 6 if self.warmup_s is None else self.warmup_s

    @property
    def window_s(self) -> float:
        """The span of samples whose median stands for the warm-up's end and the end."""
        return min(RATE_WINDOW_S, max(self.sample_every_s, self.warmup / 2))

    def limits(self) -> Limits:
        return Limits(load_slack=self.clients + self.engines, idle_slack=self.engines)

    def ports(self) -> list[int]:
        return [self.router_port, *range(self.base_port, self.base_port + self.engines)]

    def engine_flags(self) -> list[str]:
        return [
            "--kv-tokens", str(self.kv_tokens),
            "--time-scale", str(self.time_scale),
            "--served-model-name", MODEL,
            "--stream-interval", "4",
        ]  # fmt: skip


@contextlib.asynccontextmanager
async def serving_router(
    config: SoakConfig, fleet: SoakFleet, log_path: Path
) -> AsyncIterator[asyncio.subprocess.Process]:
    """``kvrouter serve`` as a process, its admin API on, its log in ``log_path``."""
    settings = {**ROUTER_SETTINGS}
    settings["upstream"] = {**settings["upstream"], "max_attempts": config.max_attempts}
    config_path = config.out / "router.yaml"
    config_path.write_text(yaml.safe_dump(settings))
    urls = [fleet.url(i) for i in range(len(fleet))]
    argv = kvrouter_command(
        DemoConfig(seed=config.seed, host=config.host),
        config.policy,
        urls,
        config.router_port,
        "--config",
        str(config_path),
    )
    fleet.router_url = f"http://{config.host}:{config.router_port}"
    fleet.admin_token = secrets.token_hex(16)  # in the environment: flags show in ps
    env = {**os.environ, "KVROUTER_ADMIN_TOKEN": fleet.admin_token}
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.DEVNULL, stderr=log, env=env
        )
    try:
        await wait_healthy([fleet.router_url], timeout_s=60)
        yield process
    finally:
        await stop_process(process)


async def _settled(
    pid: int,
    http: aiohttp.ClientSession,
    router_url: str,
    clock: Callable[[], float],
    before: Sample,
) -> Sample:
    """The first idle sample with nothing outstanding and no more descriptors or tasks
    than idle before the load, or the last one tried within ``IDLE_TIMEOUT_S`` (what the
    router still holds then is judged against the slack)."""
    deadline = clock() + IDLE_TIMEOUT_S
    while True:
        sample = await take(pid, http, router_url, clock, "idle-after")
        settled = (
            sample.outstanding == 0
            and sample.fds <= before.fds
            and (sample.tasks or 0) <= (before.tasks or 0)
        )
        if settled or clock() > deadline:
            return sample
        await asyncio.sleep(1.0)


async def _counters(http: aiohttp.ClientSession, router_url: str) -> dict[str, Any]:
    series = await scrape(http, router_url)
    outcomes = sorted({lab["outcome"] for n, lab, _ in series if n == "kvrouter_requests_total"})
    statuses = sorted(
        {lab["status"] for n, lab, _ in series if n == "kvrouter_rejected_requests_total"}
    )
    return {
        "requests_by_outcome": {
            o: total(series, "kvrouter_requests_total", outcome=o) for o in outcomes
        },
        "rejected_by_status": {
            s: total(series, "kvrouter_rejected_requests_total", status=s) for s in statuses
        },
        "retries": total(series, "kvrouter_retries_total"),
        "worker_restarts_seen": total(series, "kvrouter_worker_restarts_total"),
    }


def check_ports(host: str, ports: list[int]) -> None:
    """Every port free, or an ``OSError`` naming the first taken (an engine restarted on
    a port someone else holds would never come back)."""
    taken = first_taken(ports, host)
    if taken is not None:
        port, why = taken
        raise OSError(f"port {port} on {host} is taken: {why}")


@dataclass(slots=True)
class Observed:
    """What one run saw; times in seconds since it started."""

    records: list[Record] = field(default_factory=list)
    events: list[FaultEvent] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    load_started: float = 0.0
    load_end: float = 0.0
    counters: dict[str, Any] = field(default_factory=dict)


async def _load(
    config: SoakConfig,
    fleet: SoakFleet,
    pid: int,
    sampling: aiohttp.ClientSession,
    clock: Callable[[], float],
    seen: Observed,
) -> None:
    """The clients, the faults and the sampler, until the duration is over and the last
    fault has been recovered from."""
    seen.load_started = clock()
    stop_at = seen.load_started + config.duration_s
    traffic = TrafficConfig(MODEL, config.clients, config.think_s, config.seed)
    stop_sampling = asyncio.Event()
    sampler = asyncio.create_task(
        sample_until(
            pid,
            sampling,
            fleet.router_url,
            clock,
            config.sample_every_s,
            stop_sampling,
            seen.samples,
        )
    )
    traffic_done = asyncio.Event()
    faulting = asyncio.create_task(
        run_faults(config.faults, fleet, clock, stop_at, traffic_done, config.seed, seen.events)
    )
    try:
        async with open_http(config.clients) as http:
            await asyncio.gather(
                *(
                    client(http, fleet.router_url, traffic, i, clock, stop_at, seen.records)
                    for i in range(config.clients)
                )
            )
        seen.load_end = clock()
        traffic_done.set()
        await faulting
    finally:
        faulting.cancel()
        stop_sampling.set()
        await sampler


async def observe(config: SoakConfig, console: Console, clock: Callable[[], float]) -> Observed:
    """Engines, then the router, idle, the load, idle again; everything stopped after.

    The samples go through their own session of one connection, open throughout, so the
    benchmark's own connections to the router are the same one before and after the load;
    the faults' and admin calls' session is closed before the idle sample."""
    seen = Observed()
    timeout = aiohttp.ClientTimeout(total=30)
    async with (
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1, keepalive_timeout=SAMPLER_KEEPALIVE_S),
            timeout=timeout,
        ) as sampling,
        aiohttp.ClientSession(timeout=timeout) as control,
        contextlib.AsyncExitStack() as stack,
    ):
        engine_log = stack.enter_context((config.out / "engines.log").open("wb"))
        fleet = SoakFleet(
            config.host,
            config.base_port,
            config.engines,
            config.engine_flags(),
            control,
            engine_log,
        )
        try:
            await fleet.start_all()
            async with serving_router(config, fleet, config.out / "router.log") as router:
                url = fleet.router_url
                await scrape(sampling, url)  # its one connection, open in every count
                await asyncio.sleep(SETTLE_S)
                before = await take(router.pid, sampling, url, clock, "idle-before")
                seen.samples.append(before)
                console.print(
                    f"soak: {config.engines} engines, {config.clients} clients, "
                    f"{config.duration_s:g} s (warm-up {config.warmup:g} s); router pid "
                    f"{router.pid}, log {config.out / 'router.log'}"
                )
                await _load(config, fleet, router.pid, sampling, clock, seen)
                await control.close()  # its pooled connections are not the router's
                seen.samples.append(await _settled(router.pid, sampling, url, clock, before))
                seen.counters = await _counters(sampling, url)
        finally:
            await fleet.stop_all()
    return seen


def summarize(config: SoakConfig, seen: Observed, end: float) -> dict[str, Any]:
    requests = judge_requests(seen.records, seen.events, config.engines, end)
    figures, checks = judge_process(
        seen.samples,
        seen.load_started + config.warmup,
        seen.load_end,
        config.window_s,
        config.limits(),
    )
    summary: dict[str, Any] = {
        "settings": {
            **{k: v for k, v in asdict(config).items() if k not in ("out", "faults")},
            "warmup_s": config.warmup,
            "faults": asdict(config.faults),
            "router": ROUTER_SETTINGS,
            "limits": asdict(config.limits()),
        },
        "rate_per_s": len(seen.records) / max(seen.load_end - seen.load_started, 1e-9),
        "requests": requests,
        "faults": faults_summary(seen.events),
        "fault_events": [e.as_dict() for e in seen.events],
        "process": figures,
        "router_counters": seen.counters,
        "router_log": read_log(config.out / "router.log"),
        "samples": [s.as_dict() for s in seen.samples],
        "checks": {"no_lost_requests": requests["lost_before_first_byte"] == 0, **checks},
    }
    summary["passed"] = all(summary["checks"].values())
    return summary


async def run_soak(config: SoakConfig, console: Console) -> dict[str, Any]:
    """The whole run; prints the table, writes ``config.out``, returns the summary."""
    check_ports(config.host, config.ports())
    config.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def clock() -> float:
        return time.monotonic() - started

    seen = await observe(config, console, clock)
    summary = summarize(config, seen, clock())
    print_summary(console, summary)
    path = save(summary, seen.records, config.out)
    console.print(f"wrote {path}")
    return summary


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser(
        "soak",
        help="mixed traffic through a router process while workers fail; losses and leaks",
        description=__doc__,
    )
    parser.add_argument("--duration", type=float, default=DEFAULT_DURATION_S, help="seconds")
    parser.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds before the RSS baseline (default: duration / 6)",
    )
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument(
        "--think", type=float, default=0.5, help="mean pause between a client's requests, seconds"
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--kv-tokens", type=int, default=60_000)
    parser.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT)
    parser.add_argument("--router-port", type=int, default=DEFAULT_ROUTER_PORT)
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds")
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=2,
        help="the router's upstream.max_attempts (1 shows what a loss looks like)",
    )
    parser.add_argument("--policy", default=DEFAULT_POLICY, help="the router's policy")
    plan = FaultPlan()
    parser.add_argument(
        "--faults",
        default=",".join(plan.kinds),
        help=f"fault kinds to rotate through, of {', '.join(FAULT_KINDS)}",
    )
    parser.add_argument(
        "--fault-every",
        type=float,
        default=plan.every_s,
        help="seconds of quiet between one fault's recovery and the next",
    )
    parser.add_argument("--fault-duration", type=float, default=plan.duration_s)
    parser.add_argument(
        "--first-fault", type=float, default=plan.first_at_s, help="seconds into the run"
    )
    parser.add_argument(
        "--outage-every",
        type=float,
        default=plan.outage_every_s,
        help="seconds between outages (every engine killed); 0: none",
    )
    parser.add_argument("--outage-duration", type=float, default=plan.outage_s)
    parser.set_defaults(func=run)


def soak_config(args: argparse.Namespace) -> SoakConfig:
    return SoakConfig(
        duration_s=args.duration,
        warmup_s=args.warmup,
        engines=args.engines,
        clients=args.clients,
        think_s=args.think,
        seed=args.seed,
        out=args.out,
        time_scale=args.time_scale,
        kv_tokens=args.kv_tokens,
        base_port=args.base_port,
        router_port=args.router_port,
        sample_every_s=args.sample_every,
        max_attempts=args.max_attempts,
        policy=args.policy,
        faults=FaultPlan(
            kinds=tuple(k for k in args.faults.split(",") if k),
            every_s=args.fault_every,
            duration_s=args.fault_duration,
            outage_every_s=args.outage_every,
            outage_s=args.outage_duration,
            first_at_s=args.first_fault,
        ),
    )


def run(args: argparse.Namespace) -> int:
    try:
        summary = asyncio.run(run_soak(soak_config(args), Console()))
    except OSError as exc:
        print(f"error: {exc}")
        return 2
    return 0 if summary["passed"] else 1
