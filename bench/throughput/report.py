"""What ``kvrouter bench throughput`` measured: one ``Run`` per router, variant and round,
the tables of their medians and ranges, and the JSON they are saved as."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson
from rich.table import Table

from bench.cost.prompt import PromptCost
from bench.replay.rounds import Spread
from bench.throughput.loadgen import LoadResult

Variant = Literal["whole", "stream"]


@dataclass(frozen=True, slots=True)
class Run:
    """One measured run of one target and variant."""

    target: str
    variant: Variant
    round: int
    load: LoadResult
    router_cpu_s: float
    standin_cpu_s: float
    engine_posts: int  # POSTs the stand-ins answered: completions, tokenize, render
    router_system_share: float = 0.0  # the kernel's share of the router's CPU

    def per_request_us(self, cpu_s: float) -> float:
        return cpu_s / self.load.requests * 1e6 if self.load.requests else 0.0

    @property
    def router_us(self) -> float:
        return self.per_request_us(self.router_cpu_s)

    @property
    def standin_us(self) -> float:
        return self.per_request_us(self.standin_cpu_s)

    @property
    def engine_calls(self) -> float:
        """Engine requests per routed request (1 but for routers that ask the engines
        to tokenize)."""
        return self.engine_posts / self.load.requests if self.load.requests else 0.0


def _spread(values: Sequence[float], fmt: str) -> str:
    spread = Spread.of(values)
    if spread is None:
        return "-"
    middle = format(spread.median, fmt)
    low, high = format(spread.low, fmt), format(spread.high, fmt)
    return middle if low == high else f"{middle} ({low}-{high})"


def runs_table(runs: Sequence[Run], variant: Variant) -> Table:
    """Per target, in the order first measured: ``median (min-max)`` of each figure."""
    table = Table(title=f"{'streamed' if variant == 'stream' else 'whole'} replies")
    for column in (
        "router",
        "req/s",
        "p50 ms",
        "p99 ms",
        "router CPU µs/req",
        "of it kernel",
        "stand-in CPU µs/req",
        "engine calls/req",
        "errors",
    ):
        table.add_column(column, justify="left" if column == "router" else "right")
    labels = list(dict.fromkeys(r.target for r in runs if r.variant == variant))
    for label in labels:
        mine = [r for r in runs if r.variant == variant and r.target == label]
        table.add_row(
            label,
            _spread([r.load.rate for r in mine], ",.0f"),
            _spread([r.load.p50_s * 1e3 for r in mine], ".2f"),
            _spread([r.load.p99_s * 1e3 for r in mine], ".2f"),
            "-" if label == "direct" else _spread([r.router_us for r in mine], ".0f"),
            "-" if label == "direct" else _spread([r.router_system_share for r in mine], ".0%"),
            _spread([r.standin_us for r in mine], ".0f"),
            _spread([r.engine_calls for r in mine], ".2f"),
            str(sum(r.load.errors for r in mine)),
        )
    return table


def prompt_cost_table(costs: Sequence[PromptCost]) -> Table:
    first = costs[0]
    table = Table(
        title=f"one {first.prompt_tokens:,}-token prompt in kvrouter "
        f"({first.body_bytes:,} bytes, {first.blocks:,} blocks), median µs"
    )
    for column in (
        "policy",
        "parse+route+dispatch",
        "parse_request",
        "route_request",
        "dispatch",
        "finish",
        "orjson.loads alone",
    ):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for c in costs:
        table.add_row(
            c.policy,
            *(
                f"{s * 1e6:,.0f}"
                for s in (c.total_s, c.parse_s, c.route_s, c.dispatch_s, c.finish_s, c.orjson_s)
            ),
        )
    return table


def save(runs: Sequence[Run], costs: Sequence[PromptCost], path: Path) -> None:
    data: dict[str, Any] = {
        "runs": [
            {
                **dataclasses.asdict(r.load),
                "target": r.target,
                "variant": r.variant,
                "round": r.round,
                "rate": r.load.rate,
                "router_cpu_s": r.router_cpu_s,
                "router_system_share": r.router_system_share,
                "standin_cpu_s": r.standin_cpu_s,
                "router_us_per_request": r.router_us,
                "standin_us_per_request": r.standin_us,
                "engine_posts": r.engine_posts,
            }
            for r in runs
        ],
        "prompt_cost": [dataclasses.asdict(c) for c in costs],
    }
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
