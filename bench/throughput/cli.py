"""``kvrouter bench throughput``'s command line: the rounds (``run``) or, with
``--profile``, py-spy's view of kvrouter under the same load (``profile``)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from rich.console import Console

from bench import netns
from bench.throughput import loadgen
from bench.throughput import run as throughput_run
from bench.throughput.loadgen import Generator
from bench.throughput.profile import profile_kvrouter
from bench.throughput.report import Variant
from bench.throughput.run import (
    DEFAULT_CONNECTIONS,
    DEFAULT_DURATION_S,
    DEFAULT_ENGINES,
    DEFAULT_OUT,
    DEFAULT_POLICIES,
    DEFAULT_ROUNDS,
    DEFAULT_VARIANTS,
    DEFAULT_WARMUP_S,
    ThroughputConfig,
    run_benchmark,
)


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser(
        "throughput",
        help="requests/s and router CPU per request, engines that cost nothing",
        description=throughput_run.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--connections", type=int, default=DEFAULT_CONNECTIONS)
    parser.add_argument("--warmup", type=float, default=DEFAULT_WARMUP_S, help="seconds")
    parser.add_argument(
        "--duration",
        type=float,
        default=DEFAULT_DURATION_S,
        help="seconds measured per router, policy and variant",
    )
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument(
        "--engines",
        type=int,
        default=DEFAULT_ENGINES,
        help="stand-in workers (ports of one process)",
    )
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    parser.add_argument(
        "--kvrouter-processes",
        default="1",
        metavar="N,N",
        help="kvrouter serve --processes counts to measure, e.g. 1,2 (rows 'kvrouter "
        "round_robin ×2'; the processes share state through their own Valkey)",
    )
    parser.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS), help="whole and/or stream"
    )
    parser.add_argument(
        "--peer-bin",
        type=Path,
        help="bin/ of the peers' virtualenv (smg, vllm-router); only in a "
        "loopback-only network namespace",
    )
    parser.add_argument(
        "--load-generator",
        choices=("wrk", "python"),
        default=None,
        help="default: wrk if installed, else the Python client",
    )
    parser.add_argument(
        "--no-direct", action="store_true", help="skip the baseline straight to a stand-in"
    )
    parser.add_argument("--router-port", type=int, default=8000)
    parser.add_argument("--base-port", type=int, default=8100)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--prompt-tokens", type=int, default=100_000)
    parser.add_argument("--prompt-repeat", type=int, default=30)
    parser.add_argument(
        "--checkout",
        type=Path,
        metavar="DIR",
        help="also measure the kvrouter of another checkout of this repository (rows "
        "'kvrouter@DIR'): a change's before and after in one run",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="instead of the rounds, profile kvrouter per policy with py-spy; raw "
        "stacks and summaries to DIR",
    )
    parser.set_defaults(func=run)


def variants_of(text: str) -> tuple[Variant, ...]:
    known: dict[str, Variant] = {"whole": "whole", "stream": "stream"}
    names = [v for v in text.split(",") if v]
    if not names or not set(names) <= known.keys():
        raise ValueError(f"--variants: whole and/or stream, not {text!r}")
    return tuple(known[v] for v in names)


def processes_of(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in text.split(",") if n)
    except ValueError:
        raise ValueError(f"--kvrouter-processes: counts such as 1,2, not {text!r}") from None


def config_of(args: argparse.Namespace) -> ThroughputConfig:
    generator: Generator = "wrk" if loadgen.wrk_available() else "python"
    if args.load_generator is not None:
        generator = "wrk" if args.load_generator == "wrk" else "python"
    return ThroughputConfig(
        connections=args.connections,
        warmup_s=args.warmup,
        duration_s=args.duration,
        rounds=args.rounds,
        engines=args.engines,
        policies=tuple(p for p in args.policies.split(",") if p),
        kvrouter_processes=processes_of(args.kvrouter_processes),
        variants=variants_of(args.variants),
        peer_bin=args.peer_bin,
        generator=generator,
        direct=not args.no_direct,
        router_port=args.router_port,
        base_port=args.base_port,
        out=args.out,
        prompt_tokens=args.prompt_tokens,
        prompt_repeat=args.prompt_repeat,
        checkout=args.checkout,
    )


def run(args: argparse.Namespace) -> int:
    console = Console(width=max(Console().width, 200))  # the tables, unwrapped in a log
    try:
        config = config_of(args)
    except ValueError as exc:
        console.print(f"error: {exc}")
        return 2
    if config.generator == "wrk" and not loadgen.wrk_available():
        console.print("error: wrk is not installed (apt-get install -y wrk)")
        return 2
    if config.generator == "python":
        console.print(
            "wrk not found: the Python load generator shares the router's cores, "
            "and its figures are lower"
        )
    config.out.mkdir(parents=True, exist_ok=True)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    try:
        if args.profile is None:
            asyncio.run(run_benchmark(config, console))
        else:
            asyncio.run(profile_kvrouter(config, args.profile, console))
    except (netns.NotIsolated, RuntimeError) as exc:
        console.print(f"error: {exc}")
        return 2
    return 0
