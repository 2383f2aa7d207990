"""The routers ``kvrouter bench real`` measures, as ``RouterSpec``s for real vLLM engines.

A router is named ``POLICY:MODE`` for kvrouter or ``smg`` for SMG. kvrouter's prefix
modes, each keyed as the engines key their cache or not:

* ``text``: the default, approximate: text blocks and a modelled LRU per worker;
* ``tokens``: approximate, keyed by the model's own tokens (``prefix.tokenizer``, the
  model directory the engines serve); the router's default 16-token blocks, two to each
  of the engines' 32-token blocks;
* ``exact``: the same keys, and every engine's KV events (``workers[].kv_events``).

Each kvrouter runs from a YAML file of its own, written here and checked with the
loader ``kvrouter serve`` uses, with ``log_requests`` (its JSON lines on stdout, read
by ``bench.real.figures``) and ``worker_header``. SMG runs as ``bench peers`` runs it:
``launch --policy cache_aware``, no tokenizer.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.compare.demo import DemoConfig, RouterSpec
from bench.compare.peers import smg_command
from bench.ports import free_ports
from bench.real.vllm_cpu import VllmEngine
from router.config_loader import load_config

MODES = ("text", "tokens", "exact")
POLICIES = ("ttft", "cache_aware", "round_robin")
SMG = "smg"
DEFAULT_ROUTERS = (
    "ttft:text",
    "ttft:tokens",
    "ttft:exact",
    "cache_aware:tokens",
    "round_robin:tokens",
    SMG,
)
HOST = "127.0.0.1"
SEED = 1


@dataclass(frozen=True, slots=True)
class RouterChoice:
    """One router of the comparison: a kvrouter policy in a prefix mode, or SMG."""

    policy: str
    mode: str = ""  # kvrouter's prefix mode; empty for SMG

    @classmethod
    def parse(cls, name: str) -> RouterChoice:
        if name == SMG:
            return cls(SMG)
        policy, _, mode = name.partition(":")
        if policy not in POLICIES or mode not in MODES:
            raise ValueError(
                f"router {name!r}: give POLICY:MODE (policies {', '.join(POLICIES)}; "
                f"modes {', '.join(MODES)}) or {SMG}"
            )
        return cls(policy, mode)

    @property
    def label(self) -> str:
        return self.policy if self.policy == SMG else f"{self.policy} {self.mode}"

    @property
    def slug(self) -> str:
        return self.label.replace(" ", "-")


def kvrouter_settings(
    choice: RouterChoice, engines: Sequence[VllmEngine], model_dir: Path, port: int
) -> dict[str, Any]:
    """The YAML file's contents for one kvrouter over ``engines``."""
    workers: list[dict[str, Any]] = []
    for engine in engines:
        worker: dict[str, Any] = {"url": engine.url, "name": engine.name}
        if choice.mode == "exact":
            worker["kv_events"] = {
                "endpoint": engine.kv_events_endpoint,
                "replay_endpoint": engine.replay_endpoint,
            }
        workers.append(worker)
    settings: dict[str, Any] = {
        "host": HOST,
        "port": port,
        "policy": choice.policy,
        "seed": SEED,
        "workers": workers,
        "log_requests": True,
        "worker_header": True,
    }
    if choice.mode in ("tokens", "exact"):
        settings["prefix"] = {"tokenizer": str(model_dir)}
    return settings


def kvrouter_spec(
    choice: RouterChoice,
    engines: Sequence[VllmEngine],
    model_dir: Path,
    port: int,
    run_dir: Path,
) -> RouterSpec:
    path = run_dir / f"{choice.slug}.yaml"
    path.write_text(yaml.safe_dump(kvrouter_settings(choice, engines, model_dir, port)))
    load_config(path)  # a file kvrouter would refuse fails here, before any run
    command = (
        sys.executable, "-m", "router.cli", "--log-level", "WARNING",
        "serve", "--config", str(path), "--host", HOST, "--port", str(port),
    )  # fmt: skip
    return RouterSpec(choice.label, (command,), (port,), stdout=run_dir / f"{choice.slug}.out")


def smg_spec(binary: Path, engines: Sequence[VllmEngine], run_dir: Path) -> RouterSpec:
    port, metrics_port = free_ports(2)
    urls = [engine.url for engine in engines]
    command = smg_command(binary, DemoConfig(host=HOST), urls, port, metrics_port)
    return RouterSpec(SMG, (command,), (port,), stdout=run_dir / "smg.out")


def router_specs(
    choices: Sequence[RouterChoice],
    engines: Sequence[VllmEngine],
    model_dir: Path,
    run_dir: Path,
    smg: Path | None,
) -> list[RouterSpec]:
    """A spec per choice, each on a port of its own; SMG's needs ``smg``, its binary."""
    specs: list[RouterSpec] = []
    for choice in choices:
        if choice.policy == SMG:
            if smg is None:
                raise ValueError("smg: no binary given")
            specs.append(smg_spec(smg, engines, run_dir))
        else:
            (port,) = free_ports(1)
            specs.append(kvrouter_spec(choice, engines, model_dir, port, run_dir))
    return specs
