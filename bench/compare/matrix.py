"""``kvrouter bench matrix``: every router over every workload shape, one table.

Each row is a workload and a fleet: the coding-agent sessions with and without cache
pressure, aiperf's synthesized agentic-code sessions (24 committed ones, or
``--aiperf-agentic``), InferenceX AgentX Claude Code traces (only with
``--agentx-trace``: none are shipped), chat, shared system prompts, a mix, multi-user
QA, the Mooncake conversation trace on Azure arrival times, bursts of (near-)identical
prompts, agent sessions that spawn subagents, and a fleet with one slower worker. Each
row runs through
``bench.compare.demo.run_comparison``: every router ``--repeat`` times, interleaved, the
figures reported as median (min-max). With ``--peer-bin`` the peer routers (SMG,
vllm-router) run beside kvrouter's policies; run it inside a loopback-only network
namespace then (see ``bench.compare.peers``).

Writes ``matrix.json`` (every figure's median and range by row and router),
``matrix.md`` (the table) and ``matrix-*.png`` to ``--out``; each row's runs and plots
go to a directory of their own below it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from bench.compare.demo import (
    DEFAULT_MAX_CONTEXT,
    DemoConfig,
    RouterSpec,
    add_workload_arguments,
    demo_config,
    demo_workload,
    kvrouter_spec,
    run_comparison,
    run_on_clock,
)
from bench.compare.offered_load import run_at_loads
from bench.compare.peers import peer_specs
from bench.replay.rounds import FIGURE_BY_KEY, Rounds, show_spread
from bench.workloads import (
    agentx,
    aiperf_agentic,
    azure,
    burst,
    chat,
    mix,
    mooncake,
    qa,
    shared_prompt,
    subagents,
)
from bench.workloads.trace import Turn

DEFAULT_POLICIES = ("ttft", "cache_aware", "round_robin")
DEFAULT_OUT = Path("results/matrix")
TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
AIPERF_AGENTIC_SAMPLE = (
    Path(__file__).resolve().parents[1] / "workloads/data/aiperf_agentic_24/dataset.jsonl"
)
DEFAULT_AGENTX_TRACES = 20
ROOMY_KV_TOKENS = 1_000_000
# The columns of the one table; every figure is in matrix.json.
TABLE_FIGURES = (
    "hit_rate",
    "of_reference",
    "missed_share",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "missed_ttft_p99",
    "requests_per_s",
    "goodput_per_s",
    "retries",
    "queue_sheds",
)


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    description: str
    workload: Callable[[DemoConfig], list[Turn]]
    kv_tokens: int | None = None  # None: the demo's (cache pressure)
    per_engine_flags: tuple[tuple[str, ...], ...] = ()

    def config(self, base: DemoConfig) -> DemoConfig:
        """``base`` for this row: its memory (the demo's by default), its own output."""
        kv_tokens = self.kv_tokens if self.kv_tokens is not None else base.kv_tokens
        return dataclasses.replace(base, kv_tokens=kv_tokens, out=base.out / self.name)


def _mooncake_on_azure(config: DemoConfig, traces: Path, rows: int) -> list[Turn]:
    turns = mooncake.load(
        traces / "mooncake_fast25" / "conversation_trace.jsonl",
        mooncake.MooncakeParams(max_rows=rows),
    )
    arrivals = azure.arrival_offsets(traces / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv")
    return azure.with_arrivals(turns, arrivals)


def _aiperf_agentic(config: DemoConfig, source: Path) -> list[Turn]:
    params = aiperf_agentic.AiperfAgenticParams(max_context_tokens=DEFAULT_MAX_CONTEXT)
    return aiperf_agentic.load(source, params, config.seed)


def _agentx(config: DemoConfig, source: Path, traces: int) -> list[Turn]:
    params = agentx.AgentxParams(max_traces=traces, max_context_tokens=DEFAULT_MAX_CONTEXT)
    return agentx.load(source, params, config.seed)


def _agent_trace_rows(
    aiperf_agentic_source: Path, agentx_source: Path | None, agentx_traces: int
) -> list[Row]:
    """The outside agent traffic: aiperf's synthesized sessions, and AgentX traces when
    a file of them is given (none is shipped)."""
    found = [
        Row(
            "aiperf-agentic",
            f"aiperf 'synthesize agentic-code' sessions from {aiperf_agentic_source.name}",
            lambda c: _aiperf_agentic(c, aiperf_agentic_source),
        )
    ]
    if agentx_source is not None:
        found.append(
            Row(
                "agentx",
                f"InferenceX AgentX Claude Code traces and subagents, first {agentx_traces}",
                lambda c: _agentx(c, agentx_source, agentx_traces),
            )
        )
    return found


def rows(
    traces: Path = TRACES,
    mooncake_rows: int = 400,
    *,
    aiperf_agentic_source: Path = AIPERF_AGENTIC_SAMPLE,
    agentx_source: Path | None = None,
    agentx_traces: int = DEFAULT_AGENTX_TRACES,
) -> list[Row]:
    return [
        Row("agent", "coding-agent sessions, fleet holds ~60% of their context", demo_workload),
        Row(
            "agent-roomy",
            "the same sessions, caches large enough for all of it",
            demo_workload,
            kv_tokens=ROOMY_KV_TOKENS,
        ),
        *_agent_trace_rows(aiperf_agentic_source, agentx_source, agentx_traces),
        Row(
            "chat",
            "short chat sessions",
            lambda c: chat.generate(chat.ChatParams(sessions=80, rate=1.0), c.seed),
        ),
        Row(
            "shared-prompt",
            "users sharing a few long system prompts",
            lambda c: shared_prompt.generate(
                shared_prompt.SharedPromptParams(sessions=160, rate=2.0), c.seed
            ),
        ),
        Row(
            "mix",
            "agent, chat and shared-prompt sessions together, heavy cache pressure",
            lambda c: mix.generate(mix.MixParams(sessions=120, rate=0.15), c.seed),
        ),
        Row(
            "mix-overload",
            "the same mix arriving at 0.5/s, past what the fleet serves",
            lambda c: mix.generate(mix.MixParams(sessions=120, rate=0.5), c.seed),
        ),
        Row(
            "qa",
            "multi-user QA: a shared system prompt, long per-user history, 8 rounds",
            lambda c: qa.generate(qa.QaParams(), c.seed),
            kv_tokens=100_000,
        ),
        Row(
            "mooncake-azure",
            "Mooncake conversation trace on Azure conversation arrivals",
            lambda c: _mooncake_on_azure(c, traces, mooncake_rows),
            kv_tokens=ROOMY_KV_TOKENS,
        ),
        Row(
            "burst",
            "bursts of identical or near-identical prompts (best-of-N)",
            lambda c: burst.generate(burst.BurstParams(), c.seed),
        ),
        Row(
            "subagents",
            "coding-agent sessions that spawn subagents (Claude Code's Task tool)",
            lambda c: subagents.generate_with_subagents(subagents.SubagentParams(), c.seed),
        ),
        Row(
            "slow-worker",
            "coding-agent sessions, engine 0 an A100 among H100s",
            demo_workload,
            per_engine_flags=(("--gpu", "a100"),),
        ),
    ]


def specs_for(
    config: DemoConfig, policies: Sequence[str], peer_bin: Path | None, urls: Sequence[str]
) -> list[RouterSpec]:
    specs = [kvrouter_spec(config, policy, urls) for policy in policies]
    if peer_bin is not None:
        specs += peer_specs(config, peer_bin, urls)
    return specs


async def run_matrix(
    config: DemoConfig, selected: Sequence[Row], peer_bin: Path | None, console: Console
) -> dict[str, Rounds]:
    results: dict[str, Rounds] = {}
    for row in selected:
        row_config = row.config(config)
        console.rule(f"{row.name}: {row.description}")
        specs = functools.partial(specs_for, row_config, config.policies, peer_bin)
        if config.loads:
            results |= await run_at_loads(
                row_config, console, specs, row.workload, row.per_engine_flags, row.name
            )
        else:
            results[row.name] = await run_comparison(
                row_config,
                console,
                specs,
                workload=row.workload,
                per_engine_flags=row.per_engine_flags,
                title=row.name,
            )
        write_outputs(config.out, results, selected)
    print_matrix(console, results)
    return results


def matrix_table(results: dict[str, Rounds]) -> Table:
    table = Table(title="routing matrix: median (min-max) over rounds")
    table.add_column("workload")
    table.add_column("router")
    for key in TABLE_FIGURES:
        table.add_column(FIGURE_BY_KEY[key].title, justify="right")
    for row, rounds in results.items():
        for label in rounds.labels:
            table.add_row(
                row,
                label,
                *(
                    show_spread(rounds.spread(label, FIGURE_BY_KEY[key]), FIGURE_BY_KEY[key])
                    for key in TABLE_FIGURES
                ),
            )
    return table


def matrix_markdown(results: dict[str, Rounds], selected: Sequence[Row]) -> str:
    titles = [FIGURE_BY_KEY[key].title for key in TABLE_FIGURES]
    lines = [
        "| workload | router | " + " | ".join(titles) + " |",
        "|---|---|" + "---:|" * len(titles),
    ]
    for row, rounds in results.items():
        for label in rounds.labels:
            cells = [
                show_spread(rounds.spread(label, FIGURE_BY_KEY[key]), FIGURE_BY_KEY[key])
                for key in TABLE_FIGURES
            ]
            lines.append(f"| {row} | {label} | " + " | ".join(cells) + " |")
    described = {r.name: r.description for r in selected}
    lines += ["", *(f"- **{name}**: {_description(name, described)}" for name in results)]
    return "\n".join(lines) + "\n"


def _description(name: str, described: dict[str, str]) -> str:
    """A row's, or a row at an offered load's (``"agent 1.5x"``)."""
    if name in described:
        return described[name]
    row, _, load = name.rpartition(" ")
    return f"{described[row]}, sessions bringing {load} the measured capacity"


def write_outputs(out: Path, results: dict[str, Rounds], selected: Sequence[Row]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.json").write_bytes(
        orjson.dumps(
            {row: rounds.as_dict() for row, rounds in results.items()}, option=orjson.OPT_INDENT_2
        )
    )
    (out / "matrix.md").write_text(matrix_markdown(results, selected))
    # matplotlib: only when drawing
    from bench.compare.matrix_plots import write_load_plots, write_matrix_plots

    write_matrix_plots(results, out)
    write_load_plots(results, out)


def print_matrix(console: Console, results: dict[str, Rounds]) -> None:
    console.print(matrix_table(results))


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser(
        "matrix", help="every router over every workload shape", description=__doc__
    )
    add_workload_arguments(parser)
    parser.add_argument(
        "--rows",
        default="",
        help=f"comma-separated rows (default all: {', '.join(r.name for r in rows())})",
    )
    parser.add_argument(
        "--peer-bin", type=Path, default=None, help="bin/ directory holding smg and/or vllm-router"
    )
    parser.add_argument(
        "--traces",
        type=Path,
        default=TRACES,
        help="directory holding mooncake_fast25/ and azure_llm_2023/",
    )
    parser.add_argument(
        "--mooncake-rows",
        type=int,
        default=400,
        help="first rows of the Mooncake conversation trace to replay",
    )
    parser.add_argument(
        "--aiperf-agentic",
        type=Path,
        default=AIPERF_AGENTIC_SAMPLE,
        help="dataset.jsonl of 'aiperf synthesize agentic-code' (default: 24 sessions "
        "sharing an 8K prefix, bench/workloads/data/aiperf_agentic_24)",
    )
    parser.add_argument(
        "--agentx-trace",
        type=Path,
        help="AgentX (Weka-layout) traces: a .json, a directory of them or a .jsonl; "
        "adds the agentx row",
    )
    parser.add_argument(
        "--agentx-max-traces",
        type=int,
        default=DEFAULT_AGENTX_TRACES,
        help="first traces of --agentx-trace to replay",
    )
    parser.add_argument(
        "--load",
        type=_loads,
        default=(),
        metavar="L,...",
        help="offered loads as multiples of the fleet's capacity, measured first (every "
        "session at once): each round's sessions arrive to bring that load, open-loop",
    )
    parser.set_defaults(func=run, out=DEFAULT_OUT, policies=",".join(DEFAULT_POLICIES))


def _loads(text: str) -> tuple[float, ...]:
    try:
        loads = tuple(float(part) for part in text.split(",") if part)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers such as 0.5,1,2, got {text!r}"
        ) from None
    if not loads or min(loads) <= 0:
        raise argparse.ArgumentTypeError("loads must be > 0")
    return loads


def run(args: argparse.Namespace) -> int:
    config = dataclasses.replace(demo_config(args), loads=args.load)
    every = rows(
        args.traces,
        args.mooncake_rows,
        aiperf_agentic_source=args.aiperf_agentic,
        agentx_source=args.agentx_trace,
        agentx_traces=args.agentx_max_traces,
    )
    wanted = [name for name in args.rows.split(",") if name]
    unknown = set(wanted) - {r.name for r in every}
    if unknown:
        raise SystemExit(
            f"unknown rows: {', '.join(sorted(unknown))}; known: {', '.join(r.name for r in every)}"
        )
    selected = [r for r in every if not wanted or r.name in wanted]
    console = Console()
    if args.peer_bin is not None and config.virtual:
        console.print("peer routers run as processes: using --clock real")
        config = dataclasses.replace(config, clock="real")
    return run_on_clock(config, lambda: run_matrix(config, selected, args.peer_bin, console))
