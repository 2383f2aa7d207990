"""``kvrouter bench peers``: kvrouter beside SMG and vllm-router, same fleet, same workload.

The peers are Rust routers shipped as pip packages: SMG (``smg``, the Shepherd Model
Gateway, the continuation of SGLang's router) and ``vllm-router``. Install both into one
virtualenv of their own (``bench/peer_install.sh`` does this)::

    python3 -m venv /opt/peers
    /opt/peers/bin/pip install smg==1.13.0 vllm-router==0.1.17

and give its ``bin/`` directory as ``--peer-bin``; each peer whose binary (``smg``,
``vllm-router``) is there is measured. Routers like these can try to fetch tokenizers
from a model hub when they start, so run the whole benchmark inside a loopback-only network
namespace, never on the host network (``unshare -n`` needs root)::

    unshare -n bash -c 'ip link set lo up; kvrouter bench peers --peer-bin /opt/peers/bin'

Each peer runs with ``--policy cache_aware`` and its default knobs, and SMG a second
time as ``smg-sticky``, with its sticky sessions keyed by the replay's ``X-Session-Id``.
Without a tokenizer, SMG's cache_aware keeps a radix tree of request text per model (for
a chat request, the messages' text contents joined by spaces, without roles or
template). vllm-router's cache_aware asks every engine to tokenize each request (``POST
/v1/chat/completions/render``, then ``POST /tokenize``); the simulated engines answer
both with the ids they cache on (where an engine has neither, vllm-router routes by load
alone).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.compare.demo import (
    DemoConfig,
    RouterSpec,
    add_workload_arguments,
    demo_config,
    kvrouter_spec,
    run_comparison,
)
from router.wire.headers import SESSION_HEADER

PEER_BINARIES = ("smg", "vllm-router")


def _cache_aware_flags(
    config: DemoConfig, urls: Sequence[str], port: int, metrics_port: int
) -> tuple[str, ...]:
    """The flags both peers take alike: listen, workers, cache_aware, metrics."""
    return (
        "--host", config.host, "--port", str(port), "--worker-urls", *urls,
        "--policy", "cache_aware",
        "--prometheus-host", config.host, "--prometheus-port", str(metrics_port),
    )  # fmt: skip


def smg_command(
    binary: Path, config: DemoConfig, urls: Sequence[str], port: int, metrics_port: int
) -> tuple[str, ...]:
    return (str(binary), "launch", *_cache_aware_flags(config, urls, port, metrics_port),
            "--disable-tokenizer-autoload")  # fmt: skip


def smg_sticky_command(
    binary: Path, config: DemoConfig, urls: Sequence[str], port: int, metrics_port: int
) -> tuple[str, ...]:
    """SMG with its sticky sessions keyed by the replay's session header: every turn of
    a session on the worker its first turn went to."""
    return (*smg_command(binary, config, urls, port, metrics_port), "--sticky-sessions",
            "--routing-key-headers", SESSION_HEADER)  # fmt: skip


def vllm_router_command(
    binary: Path, config: DemoConfig, urls: Sequence[str], port: int, metrics_port: int
) -> tuple[str, ...]:
    return (str(binary), *_cache_aware_flags(config, urls, port, metrics_port))


def peer_specs(config: DemoConfig, peer_bin: Path, urls: Sequence[str]) -> list[RouterSpec]:
    """A spec for each peer binary present in ``peer_bin``; they run one at a time on
    the router port, each with its own metrics port."""
    port = config.router_port
    specs: list[RouterSpec] = []
    smg = peer_bin / "smg"
    if smg.exists():
        specs.append(
            RouterSpec("smg", (smg_command(smg, config, urls, port, port + 1000),), (port,))
        )
        sticky = smg_sticky_command(smg, config, urls, port, port + 1002)
        specs.append(RouterSpec("smg-sticky", (sticky,), (port,)))
    vllm = peer_bin / "vllm-router"
    if vllm.exists():
        specs.append(
            RouterSpec(
                "vllm-router",
                (vllm_router_command(vllm, config, urls, port, port + 1001),),
                (port,),
            )
        )
    return specs


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser(
        "peers",
        help="kvrouter vs SMG and vllm-router",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_arguments(parser)
    parser.add_argument(
        "--peer-bin",
        type=Path,
        required=True,
        help="bin/ directory of the peers' virtualenv, holding smg and/or "
        "vllm-router (e.g. /opt/peers/bin)",
    )
    parser.set_defaults(func=run, out=Path("results/peers"), clock="real")


def run(args: argparse.Namespace) -> int:
    config = demo_config(args)
    console = Console()
    peer_bin: Path = args.peer_bin
    if not any((peer_bin / name).exists() for name in PEER_BINARIES):
        console.print(
            f"error: neither {' nor '.join(PEER_BINARIES)} in {peer_bin}; "
            "install them with bench/peer_install.sh"
        )
        return 2

    def specs(urls: Sequence[str]) -> list[RouterSpec]:
        ours = [kvrouter_spec(config, policy, urls) for policy in config.policies]
        return ours + peer_specs(config, peer_bin, urls)

    asyncio.run(run_comparison(config, console, specs))
    return 0
