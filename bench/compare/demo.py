"""``kvrouter demo``: a simulated fleet, the router under several policies, one comparison.

Starts ``--engines`` simulated vLLM engines (one process each), generates the built-in
coding-agent workload, and for each policy starts ``kvrouter serve`` in front of the
fleet, empties every engine's cache (a simulated restart) and replays the workload
through it. Ends with the side-by-side table and the plots (TTFT CDF, hit rate by turn).

The engines get a deliberately small KV cache (``--kv-tokens``) so the fleet holds less
context than the sessions need: that is where routing decides the hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import aiohttp
from rich.console import Console

from bench.compare.inprocess import (
    InProcessEngine,
    ensure_hash_seed,
    inprocess_fleet,
    inprocess_router,
    run_virtual,
)
from bench.ports import first_taken
from bench.replay.client import Assign, discover_model
from bench.replay.progress import ProgressDisplay
from bench.replay.reference import ReferenceParams, capacity_reference
from bench.replay.result import RunResult, save_result
from bench.replay.rounds import Rounds, ScoredRun, print_rounds, rotated
from bench.replay.runner import DEFAULT_CONCURRENCY, ReplayConfig, replay, select_sessions
from bench.sim.fleet import EngineProcess, fleet, wait_healthy
from bench.workloads.agent import AgentParams, generate
from bench.workloads.api_bodies import APIS, DEFAULT_API, Api
from bench.workloads.trace import Turn, group_sessions, write_trace
from router.cli.help_format import DefaultsHelpFormatter
from router.config import AdmissionConfig

log = logging.getLogger(__name__)

DEFAULT_POLICIES = ("round_robin", "cache_aware", "ttft")
DEFAULT_ENGINES = 4
DEFAULT_SESSIONS = 16
DEFAULT_RATE = 0.05  # sessions/s (simulated): ~one new agent session every 20 s
DEFAULT_KV_TOKENS = 150_000  # per engine: the fleet holds ~60% of the sessions' context
DEFAULT_MAX_CONTEXT = 90_000  # keeps every prompt under the engines' max_model_len
DEFAULT_TIME_SCALE = 10.0  # low enough that the engines' own CPU time stays small
DEFAULT_OUT = Path("results/demo")
DEFAULT_REPEAT = 3
Clock = Literal["virtual", "real"]
DEFAULT_CLOCK: Clock = "virtual"
# Generous: a cold 90K-token prefill queued behind others takes a minute simulated.
REQUEST_TIMEOUT_S = 3600.0
VIRTUAL_STREAM_FLUSH_MS = 2000


@dataclass(frozen=True, slots=True)
class DemoConfig:
    engines: int = DEFAULT_ENGINES
    sessions: int = DEFAULT_SESSIONS
    rate: float = DEFAULT_RATE
    seed: int = 7
    kv_tokens: int = DEFAULT_KV_TOKENS
    time_scale: float = DEFAULT_TIME_SCALE
    policies: tuple[str, ...] = DEFAULT_POLICIES
    out: Path = DEFAULT_OUT
    base_port: int = 8100
    router_port: int = 8000
    host: str = "127.0.0.1"
    repeat: int = DEFAULT_REPEAT
    clock: Clock = DEFAULT_CLOCK
    api: Api = DEFAULT_API  # the API the replay sends the turns through
    slo_ttft_s: float | None = None  # the TTFT objective goodput counts against
    retries: int = 0  # a refused turn is sent again this many times (bench.replay.runner)
    concurrency: int = DEFAULT_CONCURRENCY  # the replay's requests in flight, at most
    # Offered load as a multiple of the fleet's measured capacity (bench.compare.offered_load);
    # None: the workload's own arrival times.
    loads: tuple[float, ...] = ()

    @property
    def virtual(self) -> bool:
        return self.clock == "virtual"

    @property
    def engine_time_scale(self) -> float:
        """Simulated seconds per second of the run's clock."""
        return 1.0 if self.virtual else self.time_scale


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """A router to measure: a label and the commands that serve it, one per replica,
    the i-th listening on ``ports[i]``; clients spread requests over the replicas."""

    label: str
    commands: tuple[tuple[str, ...], ...]
    ports: tuple[int, ...]
    assign: Assign = "random"  # how the replay spreads requests over the replicas
    # Where each replica's stdout goes (e.g. its --log-requests lines), the i-th replica
    # to ``{stdout}.{i}``; None: discarded. Real clock only.
    stdout: Path | None = None
    api: Api | None = None  # the API the replay speaks to it; None: the config's


# A policy label with this after its name runs the policy with the router's queue on.
QUEUE_SUFFIX = "+queue"
# The queue's settings that are times (seconds of the engines' work or of waiting).
QUEUE_TIMES = (
    "max_queued_prefill_s",
    "queue_timeout_s",
    "first_turn_queue_timeout_s",
    "ttft_target_s",
    "door_window_s",
    "batch_queue_timeout_s",
    "min_retry_after_s",
)


def queue_settings(given: str, time_scale: float) -> list[str]:
    """``--admission`` values for a ``+queue:K=V:...`` label. The queue's times are the
    engines' times: on the real clock, with engines ``time_scale`` times faster than
    real, every one of them (given or default) is divided by it."""
    settings: dict[str, str] = {"enabled": "true"}
    if time_scale != 1.0:
        defaults = AdmissionConfig()
        settings |= {name: str(getattr(defaults, name)) for name in QUEUE_TIMES}
    for pair in (p for p in given.split(":") if p):
        name, _, value = pair.partition("=")
        settings[name] = value
    for name in QUEUE_TIMES:
        if name in settings and time_scale != 1.0:
            settings[name] = f"{float(settings[name]) / time_scale:g}"
    return [f"{name}={value}" for name, value in settings.items()]


def kvrouter_command(
    config: DemoConfig, policy: str, worker_urls: Sequence[str], port: int, *extra: str
) -> tuple[str, ...]:
    """``policy`` is a policy's name, or ``<name>+queue`` for the policy with the
    router's queue on (``admission.enabled``), or ``<name>+queue:K=V:K=V`` with more
    of the queue's settings (``ttft+queue:queue_timeout_s=3``)."""
    workers = [arg for url in worker_urls for arg in ("--worker", url)]
    policy, queued, settings = policy.partition(QUEUE_SUFFIX)
    if queued:
        pairs = queue_settings(settings, config.engine_time_scale)
        extra = (*(arg for pair in pairs for arg in ("--admission", pair)), *extra)
    return (
        sys.executable,
        "-m",
        "router.cli",
        "--log-level",
        "WARNING",
        "serve",
        "--host",
        config.host,
        "--port",
        str(port),
        "--policy",
        policy,
        "--seed",
        str(config.seed),
        "--worker-header",
        *workers,
        *extra,
    )


def kvrouter_spec(config: DemoConfig, policy: str, worker_urls: Sequence[str]) -> RouterSpec:
    return RouterSpec(
        policy,
        (kvrouter_command(config, policy, worker_urls, config.router_port),),
        (config.router_port,),
    )


async def stop_process(process: asyncio.subprocess.Process, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``; reaped either way."""
    if process.returncode is None:
        process.terminate()
    try:
        await asyncio.wait_for(process.wait(), timeout_s)
    except TimeoutError:
        process.kill()
        await process.wait()


def _log_file(stdout: Path, replica: int) -> BinaryIO:
    """Replica ``replica``'s stdout file (a local file: opening it does not wait)."""
    return Path(f"{stdout}.{replica}").open("wb")


@contextlib.asynccontextmanager
async def running_router(spec: RouterSpec, host: str) -> AsyncIterator[list[str]]:
    """Every replica of ``spec`` running and healthy; yields their base URLs."""
    processes: list[asyncio.subprocess.Process] = []
    urls = [f"http://{host}:{port}" for port in spec.ports]
    try:
        for i, argv in enumerate(spec.commands):
            with contextlib.ExitStack() as files:
                out: Any = asyncio.subprocess.DEVNULL
                if spec.stdout is not None:
                    out = files.enter_context(_log_file(spec.stdout, i))
                processes.append(
                    await asyncio.create_subprocess_exec(
                        *argv, stdout=out, stderr=asyncio.subprocess.DEVNULL
                    )
                )
        await wait_healthy(urls, timeout_s=60)
        yield urls
    finally:
        for process in processes:
            await stop_process(process)


async def empty_caches(engines: Sequence[EngineProcess | InProcessEngine]) -> None:
    async with aiohttp.ClientSession() as http:
        for engine in engines:
            async with http.post(f"{engine.url}/sim/restart") as response:
                response.raise_for_status()


RouterSpecs = Callable[[Sequence[str]], Sequence[RouterSpec]]
# Read from the routers (the spec measured, its URLs) once a replay is over, while they
# still run: figures kept beside the run's.
AfterRun = Callable[[RouterSpec, Sequence[str]], Awaitable[Mapping[str, float]]]


def demo_workload(config: DemoConfig) -> list[Turn]:
    return generate(
        AgentParams(
            sessions=config.sessions, rate=config.rate, max_context_tokens=DEFAULT_MAX_CONTEXT
        ),
        config.seed,
    )


def engine_flags(config: DemoConfig) -> list[str]:
    flags = [
        "--kv-tokens",
        str(config.kv_tokens),
        "--time-scale",
        str(config.engine_time_scale),
        "--stream-interval",
        "8",
    ]
    if config.virtual:
        # Chunks between the first and the last are timed by nobody; fewer of them are
        # fewer clock jumps.
        flags += ["--stream-flush-ms", str(VIRTUAL_STREAM_FLUSH_MS)]
    return flags


@contextlib.asynccontextmanager
async def engines_for(
    config: DemoConfig,
    per_engine_flags: Sequence[Sequence[str]],
) -> AsyncIterator[Sequence[EngineProcess | InProcessEngine]]:
    if config.virtual:
        # In this process the engines' and routers' info logs would flood the console;
        # as processes they run at WARNING.
        for name in ("bench.sim", "router", "policies"):
            logging.getLogger(name).setLevel(logging.WARNING)
        async with inprocess_fleet(
            config.engines, config.base_port, engine_flags(config), per_engine_flags
        ) as engines:
            yield engines
    else:
        async with fleet(
            config.engines, config.host, config.base_port, engine_flags(config), per_engine_flags
        ) as processes:
            yield processes


@contextlib.asynccontextmanager
async def router_for(config: DemoConfig, spec: RouterSpec) -> AsyncIterator[list[str]]:
    """Every replica of ``spec`` serving: processes on the real clock, or apps in this
    process in virtual time; yields their base URLs."""
    if not config.virtual:
        async with running_router(spec, config.host) as urls:
            yield urls
        return
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(inprocess_router(command, port))
            for command, port in zip(spec.commands, spec.ports, strict=True)
        ]


Workload = Callable[[DemoConfig], Sequence[Turn]]


def extras_path(run_path: Path) -> Path:
    """Where a run's figures read from the routers after it are kept (``ttft.r1.json``:
    ``ttft.r1.extras.json``), for ``bench rescore``: its records cannot rebuild them."""
    return run_path.with_suffix(".extras.json")


async def run_comparison(
    config: DemoConfig,
    console: Console,
    specs_for: RouterSpecs,
    before_each: Callable[[], Awaitable[None]] | None = None,
    workload: Workload = demo_workload,
    per_engine_flags: Sequence[Sequence[str]] = (),
    title: str | None = None,
    after_each: AfterRun | None = None,
    when_ready: Callable[[RouterSpec, Sequence[str]], Awaitable[None]] | None = None,
    retime: Callable[[list[Turn]], list[Turn]] | None = None,
) -> Rounds:
    """Replay a workload (default: the demo's agent sessions), its arrivals ``retime``d
    if given, through each router in front of the same fleet, ``config.repeat`` rounds
    with the routers' order rotated each round; ``before_each`` runs before each router
    starts (e.g. to empty shared state), ``when_ready`` once it serves, ``after_each``
    after its replay with the router's spec and URLs (figures read from the routers,
    kept beside the run's); ``per_engine_flags[i]`` are extra flags for engine
    ``i`` (e.g. a slower one). Prints medians and ranges; writes every run,
    ``rounds.json`` and the plots of the last round to ``config.out``.

    On the real clock every round replays the same trace, so the range is the machine's
    noise. In virtual time the same trace gives the same figures every time, so round
    ``r`` draws the workload with seed ``config.seed + r`` instead and the range is how
    much the answer depends on the particular sessions; routers are still compared on
    the same traces, round by round.
    """
    config.out.mkdir(parents=True, exist_ok=True)
    reference = ReferenceParams(config.engines, config.kv_tokens)
    rounds = Rounds()
    last_round: dict[str, RunResult] = {}
    async with engines_for(config, per_engine_flags) as engines:
        clock = "virtual time" if config.virtual else f"real time, time scale {config.time_scale:g}"
        console.print(
            f"fleet: {config.engines} simulated engines, {config.kv_tokens:,} KV "
            f"tokens each, {clock}"
        )
        specs = specs_for([e.url for e in engines])
        async with aiohttp.ClientSession() as http:
            # From the engine: some peer routers answer /v1/models only with a tokenizer.
            model = await discover_model(http, engines[0].url)
        for round_index in range(config.repeat):
            seed = config.seed + round_index if config.virtual else config.seed
            turns = list(workload(dataclasses.replace(config, seed=seed)))
            if retime is not None:  # another offered load (bench.compare.offered_load)
                turns = retime(turns)
            trace_path = config.out / f"trace.r{round_index + 1}.jsonl"
            write_trace(turns, trace_path)
            sessions = select_sessions(turns)
            console.print(
                f"round {round_index + 1}/{config.repeat}: workload seed {seed}, "
                f"{len(group_sessions(turns))} sessions, {len(turns)} turns"
            )
            for spec in rotated(specs, round_index):
                await empty_caches(engines)
                await wait_healthy([e.url for e in engines])
                if before_each is not None:
                    await before_each()
                async with router_for(config, spec) as urls:
                    if when_ready is not None:
                        await when_ready(spec, urls)
                    console.print(
                        f"round {round_index + 1}/{config.repeat} {spec.label}: "
                        f"replaying through {', '.join(urls)}"
                    )
                    replay_config = ReplayConfig(
                        target=urls[0],
                        more_targets=tuple(urls[1:]),
                        assign=spec.assign,
                        trace=trace_path,
                        model=model,
                        time_scale=config.engine_time_scale,
                        request_timeout_s=REQUEST_TIMEOUT_S,
                        api=spec.api or config.api,
                        slo_ttft_s=config.slo_ttft_s,
                        retries=config.retries,
                        concurrency=config.concurrency,
                    )
                    total = sum(len(s.turns) for s in sessions)
                    async with ProgressDisplay(total) as display:
                        result = await replay(replay_config, sessions, display.add)
                    extras = await after_each(spec, urls) if after_each is not None else None
                run_path = config.out / f"{spec.label}.r{round_index + 1}.json"
                save_result(result, run_path)
                # The standard library's JSON: a wait past the last bucket is inf.
                extras_path(run_path).write_text(json.dumps(dict(extras or {})))
                ref = capacity_reference(turns, result.records, reference)
                rounds.add(spec.label, ScoredRun.of(result, ref.hit_rate, extras))
                last_round[spec.label] = result
    labels = [spec.label for spec in specs]
    print_rounds(console, rounds, title)
    rounds.save(config.out / "rounds.json")
    from bench.replay.plots import write_plots  # matplotlib: only when drawing

    plots = write_plots([last_round[label] for label in labels], labels, config.out)
    console.print(
        f"results: {config.out}/rounds.json; plots: {', '.join(str(p) for p in plots)}",
        soft_wrap=True,
    )
    return rounds


async def run_demo(config: DemoConfig, console: Console) -> Rounds:
    return await run_comparison(
        config,
        console,
        lambda urls: [kvrouter_spec(config, policy, urls) for policy in config.policies],
    )


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engines", type=int, default=DEFAULT_ENGINES, help="simulated engines in the fleet"
    )
    parser.add_argument(
        "--sessions", type=int, default=DEFAULT_SESSIONS, help="coding-agent sessions replayed"
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=DEFAULT_RATE,
        help="agent sessions arriving per simulated second",
    )
    parser.add_argument(
        "--seed", type=int, default=7, help="the workload's seed (round i uses seed + i)"
    )
    parser.add_argument(
        "--kv-tokens", type=int, default=DEFAULT_KV_TOKENS, help="KV cache per engine, in tokens"
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=DEFAULT_TIME_SCALE,
        help="--clock real: the engines run this many times faster than real time",
    )
    parser.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="comma-separated kvrouter policies to compare",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="directory for the trace, results and plots"
    )
    parser.add_argument(
        "--base-port",
        type=int,
        default=8100,
        help="engine i listens on this port + i (on loopback, in virtual time too)",
    )
    parser.add_argument(
        "--router-port", type=int, default=8000, help="the router's port (on loopback)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=DEFAULT_REPEAT,
        help="rounds; each figure is reported as median (min-max)",
    )
    parser.add_argument(
        "--clock",
        choices=("virtual", "real"),
        default=DEFAULT_CLOCK,
        help="virtual: engines and kvrouter in this process, simulated time "
        "jumps when idle (fast, exact, unaffected by CPU load); real: "
        "processes on the wall clock sped up by --time-scale (needed "
        "for peer routers)",
    )
    parser.add_argument(
        "--api",
        choices=APIS,
        default=DEFAULT_API,
        help="the API the replay speaks: OpenAI chat completions, OpenAI responses "
        "or Anthropic messages (default %(default)s)",
    )
    parser.add_argument(
        "--slo-ttft",
        type=float,
        dest="slo_ttft_s",
        metavar="SECS",
        help="a time-to-first-token objective in simulated seconds: every table adds "
        "goodput, the turns a second within it",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=0,
        metavar="N",
        help="send a refused turn again up to N times as the SDKs do (they default to "
        "2); a session refused after them gives up",
    )


def demo_config(args: argparse.Namespace) -> DemoConfig:
    return DemoConfig(
        engines=args.engines,
        sessions=args.sessions,
        rate=args.rate,
        seed=args.seed,
        kv_tokens=args.kv_tokens,
        time_scale=args.time_scale,
        policies=tuple(p for p in args.policies.split(",") if p),
        out=args.out,
        base_port=args.base_port,
        router_port=args.router_port,
        repeat=args.repeat,
        clock=args.clock,
        api=args.api,
        slo_ttft_s=args.slo_ttft_s,
        retries=args.retries,
    )


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "demo",
        help="simulated fleet + router: compare policies on an agent workload",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    add_workload_arguments(parser)
    parser.set_defaults(func=run)


def run_on_clock(config: DemoConfig, main: Callable[[], Coroutine[Any, Any, Any]]) -> int:
    """Run ``main()`` on the event loop ``config.clock`` asks for (in virtual time, with
    the fixed hash seed it needs, re-executing this command if it must); the command's
    exit status. A port it needs that is taken is one line naming the flags to change
    (the engines listen on loopback ports even in virtual time)."""
    wanted = [config.base_port + i for i in range(config.engines)] + [config.router_port]
    taken = first_taken(wanted, config.host)
    if taken is not None:
        port, why = taken
        print(
            f"error: port {port} is taken ({why}): choose others with --base-port "
            f"(engines: {config.engines} ports from it) and --router-port"
        )
        return 2
    if config.virtual:
        ensure_hash_seed(sys.argv[1:])
        run_virtual(main())
    else:
        asyncio.run(main())
    return 0


def run(args: argparse.Namespace) -> int:
    config = demo_config(args)
    return run_on_clock(config, lambda: run_demo(config, Console()))
