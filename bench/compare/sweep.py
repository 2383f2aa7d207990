"""``kvrouter bench sweep``: one policy knob over a range of values, as an operator tunes.

``kvrouter bench sweep --policy ttft --knob cache_weight=0,0.5,1,2,4 --row agent`` runs
the router once per value (each value a router of its own, interleaved and repeated like
every comparison here) on one workload row of ``bench matrix``, then writes a table and
a plot of hit rate and TTFT p90/p99 against the knob to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.compare.demo import (
    DemoConfig,
    RouterSpec,
    add_workload_arguments,
    demo_config,
    kvrouter_command,
    run_comparison,
    run_on_clock,
)
from bench.compare.matrix import TRACES, Row, rows
from bench.replay.rounds import Rounds
from policies.registry import build_policy

KnobValue = float | bool


def parse_knob(text: str) -> tuple[str, list[KnobValue]]:
    """``name=v1,v2,...`` -> (name, [v1, v2, ...]): numbers, or true and false."""
    name, sep, values = text.partition("=")
    if not sep or not name or not values:
        raise argparse.ArgumentTypeError(f"expected NAME=V1,V2,..., got {text!r}")
    parsed: list[KnobValue] = []
    for value in (v for v in values.split(",") if v):
        if value.lower() in ("true", "false"):
            parsed.append(value.lower() == "true")
            continue
        try:
            parsed.append(float(value))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"knob values must be numbers or true/false: {text!r}"
            ) from exc
    return name, parsed


def knob_text(value: KnobValue) -> str:
    """The value as ``--policy-knob`` reads it."""
    return str(value).lower() if isinstance(value, bool) else f"{value:g}"


def label_for(knob: str, value: KnobValue) -> str:
    return f"{knob}={knob_text(value)}"


def sweep_specs(
    config: DemoConfig, policy: str, knob: str, values: Sequence[KnobValue], urls: Sequence[str]
) -> list[RouterSpec]:
    return [
        RouterSpec(
            label_for(knob, v),
            (
                kvrouter_command(
                    config,
                    policy,
                    urls,
                    config.router_port,
                    "--policy-knob",
                    f"{knob}={knob_text(v)}",
                ),
            ),
            (config.router_port,),
        )
        for v in values
    ]


async def run_sweep(
    config: DemoConfig,
    row: Row,
    policy: str,
    knob: str,
    values: Sequence[KnobValue],
    console: Console,
) -> Rounds:
    row_config = dataclasses.replace(
        config, kv_tokens=row.kv_tokens if row.kv_tokens is not None else config.kv_tokens
    )
    rounds = await run_comparison(
        row_config,
        console,
        lambda urls: sweep_specs(row_config, policy, knob, values, urls),
        workload=row.workload,
        per_engine_flags=row.per_engine_flags,
        title=f"{policy}: {knob} on {row.name}",
    )
    from bench.compare.matrix_plots import write_sweep_plot  # matplotlib: only when drawing

    path = write_sweep_plot(
        knob, values, rounds, [label_for(knob, v) for v in values], config.out / f"sweep-{knob}.png"
    )
    console.print(f"wrote {path}", highlight=False, markup=False)
    return rounds


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser(
        "sweep", help="one policy knob over a range of values", description=__doc__
    )
    add_workload_arguments(parser)
    parser.add_argument("--policy", default="ttft")
    parser.add_argument("--knob", type=parse_knob, required=True, metavar="NAME=V1,V2,...")
    parser.add_argument("--row", default="agent", help="a workload row of bench matrix")
    parser.add_argument("--traces", type=Path, default=TRACES)
    parser.set_defaults(func=run, out=Path("results/sweep"))


def run(args: argparse.Namespace) -> int:
    config = demo_config(args)
    by_name = {r.name: r for r in rows(args.traces)}
    if args.row not in by_name:
        raise SystemExit(f"unknown row {args.row!r}; known: {', '.join(by_name)}")
    knob, values = args.knob
    for value in values:  # fail now, not after the fleet started
        try:
            build_policy(args.policy, {knob: value})
        except ValueError as exc:
            raise SystemExit(f"{args.policy}: {exc}") from exc
    return run_on_clock(
        config, lambda: run_sweep(config, by_name[args.row], args.policy, knob, values, Console())
    )
