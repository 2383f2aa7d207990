"""``kvrouter bench tiers``: routing that knows the engines' CPU tiers against routing
that does not.

Every simulated engine keeps a CPU tier behind its GPU cache (vLLM's native offloading
connector, ``bench/sim/offload.py``): every block it caches is written there, a prompt
whose GPU hit stops short reads the rest back over the host link before it runs. The
engines publish their KV events (the CPU tier's with their tokens,
``self_describing_kv_events``) and encode prompts with a real tokenizer, so kvrouter
runs in exact mode. Routers, in front of the same fleet:

* ``tier-aware``: ``ttft`` over every engine's GPU and CPU residency, a CPU-tier hit
  priced by its reload (``offload`` settings: the engines' KV bytes per token, the link),
  a reload onto a full GPU a tie the least busy near worker takes (``spread_reloads``);
* ``tier-sticky``: the same without ``spread_reloads``: the reload's saving decides;
* ``tier-blind``: the same router with ``count_offloaded=false``: it sees the GPU alone;
* with ``--peer-bin``, SMG 1.13's ``cache_aware`` (it sees neither tier; run inside a
  loopback-only network namespace).

Figures, beside the replay's: from the engines' own records (``GET /sim/requests``,
whatever router sent the turns), the share of prompt tokens found on the GPU and read
back from the CPU, the turns that read some back and their TTFT (engine-side, first
token less arrival, simulated seconds); from kvrouter's request log, the turns it sent
to a worker whose CPU tier held what its GPU did not.

On the real clock (events cross ZMQ in real time), ``--repeat`` rounds of the same trace.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import yaml
from rich.console import Console

from bench.compare.agreement import (
    LOG_SETTLE_S,
    add_exact_mode_arguments,
    engine_flags,
    engine_records,
    exact_workers,
    log_of,
    read_request_log,
)
from bench.compare.demo import (
    DemoConfig,
    RouterSpec,
    add_workload_arguments,
    demo_config,
    demo_workload,
    kvrouter_command,
    run_comparison,
)
from bench.compare.peers import peer_specs
from bench.cost.tokenize import qwen3_dir
from bench.replay.rounds import Rounds
from bench.sim.cli import DEFAULT_MODEL, GIB
from router.planning.capacity import load_model

DEFAULT_OUT = Path("results/tiers")
# The CPU tier behind each engine, in multiples of its GPU cache: a host's memory is
# several times its GPUs'.
DEFAULT_TIER_FACTOR = 4.0
# SMG's prefix-aware policy (its sticky sessions measured below it on these sessions).
PEERS = ("smg",)
SELF_DESCRIBING = '{"kv_connector_extra_config": {"self_describing_kv_events": true}}'


def offload_flags(config: DemoConfig, tier_factor: float) -> list[list[str]]:
    """Per engine: a CPU tier ``tier_factor`` times its GPU cache, self-describing."""
    per_token = load_model(DEFAULT_MODEL).kv_bytes_per_token()
    gib = config.kv_tokens * tier_factor * per_token / GIB
    flags = ["--kv-offloading-size", f"{gib:.6f}", "--kv-transfer-config", SELF_DESCRIBING]
    return [list(flags) for _ in range(config.engines)]


def router_specs(
    config: DemoConfig,
    urls: Sequence[str],
    model_dir: Path,
    base_port: int,
    run_dir: Path,
    peer_bin: Path | None,
) -> list[RouterSpec]:
    port = config.router_port
    workers = exact_workers(config, urls, base_port)
    # The engines' model, for the KV bytes a token takes (what a reload reads).
    capacity = {"model": DEFAULT_MODEL, "gpu": "h100", "kv_tokens": config.kv_tokens}
    path = run_dir / "tiers.yaml"
    path.write_text(yaml.safe_dump({"workers": workers, "capacity": capacity}))
    specs = []
    aware = ("--policy-knob", "count_offloaded=true")
    for label, knobs in (
        ("tier-aware", (*aware, "--policy-knob", "spread_reloads=true")),
        ("tier-sticky", (*aware, "--policy-knob", "spread_reloads=false")),
        ("tier-blind", ("--policy-knob", "count_offloaded=false")),
    ):
        command = kvrouter_command(
            config,
            "ttft",
            (),
            port,
            "--log-requests",
            "--tokenizer",
            str(model_dir),
            "--config",
            str(path),
            *knobs,
        )
        specs.append(RouterSpec(label, (command,), (port,), stdout=run_dir / f"{label}.requests"))
    if peer_bin is not None:
        specs += [s for s in peer_specs(config, peer_bin, urls) if s.label in PEERS]
    return specs


def tier_figures(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """From the engines' records of a run: where the cached tokens came from, and the
    turns that read some back from the CPU tier."""
    served = [r for r in records if r.get("cached_at_schedule") is not None]
    prompt = sum(int(r["prompt_tokens"]) for r in served) or 1
    loaded = sum(int(r.get("loaded") or 0) for r in served)
    cached = sum(int(r["cached_at_schedule"]) for r in served)
    reloaded = [r for r in served if r.get("loaded")]
    ttfts = sorted(
        float(r["first_token"]) - float(r["arrived"])
        for r in reloaded
        if r.get("first_token") is not None
    )
    figures = {
        "gpu_hit_share": (cached - loaded) / prompt,
        "cpu_hit_share": loaded / prompt,
        "reloaded_turns": float(len(reloaded)),
    }
    if ttfts:
        figures["reloaded_ttft_p50"] = statistics.median(ttfts)
        figures["reloaded_ttft_p99"] = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
    return figures


class TierScorer:
    def __init__(self) -> None:
        self.engine_urls: Sequence[str] = ()

    async def score(self, spec: RouterSpec, urls: Sequence[str]) -> dict[str, float]:
        del urls
        await asyncio.sleep(LOG_SETTLE_S)
        figures = tier_figures(await engine_records(self.engine_urls))
        if spec.stdout is not None:
            lines = [
                line
                for i in range(len(spec.commands))
                for line in read_request_log(log_of(spec, i))
            ]
            sent = sum(1 for line in lines if int(line.get("offloaded_tokens") or 0) > 0)
            figures["sent_to_cpu_holder"] = float(sent)
        return figures


async def run_tiers(
    config: DemoConfig,
    model_dir: Path,
    base_port: int,
    tier_factor: float,
    peer_bin: Path | None,
    console: Console,
) -> Rounds:
    logs = config.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    scorer = TierScorer()

    def specs(urls: Sequence[str]) -> list[RouterSpec]:
        scorer.engine_urls = urls
        return router_specs(config, urls, model_dir, base_port, logs, peer_bin)

    flags = engine_flags(config, model_dir, base_port, offload_flags(config, tier_factor))
    rounds = await run_comparison(
        config,
        console,
        specs,
        workload=demo_workload,
        per_engine_flags=flags,
        title=(
            f"agent sessions, {config.kv_tokens:,} GPU KV tokens per engine, a CPU tier "
            f"{tier_factor:g}x that"
        ),
        after_each=scorer.score,
    )
    return rounds


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser(
        "tiers",
        help="routing that knows the engines' CPU tiers against routing that does not",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_arguments(parser)
    add_exact_mode_arguments(parser)
    parser.add_argument(
        "--tier-factor",
        type=float,
        default=DEFAULT_TIER_FACTOR,
        help="each engine's CPU tier, in multiples of its GPU cache",
    )
    parser.add_argument(
        "--peer-bin",
        type=Path,
        default=None,
        help="a folder with SMG's binary (smg): compare with it too (in a loopback-only "
        "network namespace)",
    )
    parser.set_defaults(func=run, out=DEFAULT_OUT, clock="real")


def run(args: argparse.Namespace) -> int:
    if not args.tier_factor > 0:
        raise SystemExit("bench tiers: --tier-factor must be > 0")
    config = dataclasses.replace(demo_config(args), clock="real")
    console = Console()
    rounds = asyncio.run(
        run_tiers(
            config,
            args.model_dir or qwen3_dir(),
            args.kv_events_port,
            args.tier_factor,
            args.peer_bin,
            console,
        )
    )
    summary = orjson.dumps(rounds.as_dict(), option=orjson.OPT_INDENT_2)
    (config.out / "tiers.json").write_bytes(summary)
    return 0
