"""``kvrouter bench peers``: kvrouter beside SGLang's router and vllm-router, same fleet,
same workload.

The peer routers are Rust binaries installed with pip (``sglang-router``, ``vllm-router``),
ideally in their own virtualenv, given by ``--peer-bin``. They try to download a tokenizer
when they start, so run this inside a loopback-only network namespace::

    unshare -n bash -c 'ip link set lo up; kvrouter bench peers --peer-bin /opt/peers/bin'
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.demo import (
    DemoConfig,
    RouterSpec,
    add_workload_arguments,
    demo_config,
    kvrouter_spec,
    run_comparison,
)


def peer_specs(config: DemoConfig, peer_bin: Path, urls: Sequence[str]) -> list[RouterSpec]:
    port = config.router_port
    specs: list[RouterSpec] = []
    sglang = peer_bin / "python"
    if sglang.exists():
        specs.append(RouterSpec("sglang-router", ((
            str(sglang), "-m", "sglang_router.launch_router", "--host", config.host,
            "--port", str(port), "--policy", "cache_aware", "--prometheus-host", config.host,
            "--prometheus-port", str(port + 1000), "--worker-urls", *urls,
        ),), (port,)))
    vllm = peer_bin / "vllm-router"
    if vllm.exists():
        specs.append(RouterSpec("vllm-router", ((
            str(vllm), "--host", config.host, "--port", str(port), "--policy", "cache_aware",
            "--prometheus-host", config.host, "--prometheus-port", str(port + 1001),
            "--worker-urls", *urls,
        ),), (port,)))
    return specs


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser("peers", help="kvrouter vs sglang-router and vllm-router",
                            description=__doc__)
    add_workload_arguments(parser)
    parser.add_argument("--peer-bin", type=Path, required=True,
                        help="bin/ directory holding the peer routers (a virtualenv's)")
    parser.set_defaults(func=run, out=Path("results/peers"))


def run(args: argparse.Namespace) -> int:
    config = demo_config(args)
    console = Console()

    def specs(urls: Sequence[str]) -> list[RouterSpec]:
        ours = [kvrouter_spec(config, policy, urls) for policy in config.policies]
        return ours + peer_specs(config, args.peer_bin, urls)

    asyncio.run(run_comparison(config, console, specs))
    return 0
