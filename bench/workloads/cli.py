"""``kvrouter bench gen KIND``: write a workload trace and print its shape.

Every kind is one entry of ``GENERATORS`` (name -> how to add its flags, how to build
its turns); argparse turns the registry into sub-commands, so an unknown KIND is an
error that lists the known ones.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from bench.workloads import (
    agent,
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
from bench.workloads.api_bodies import APIS, Api
from bench.workloads.flags import named_weights
from bench.workloads.stats import describe, summarize
from bench.workloads.trace import Turn, write_trace


@dataclass(frozen=True, slots=True)
class Generator:
    help: str
    # The kind's own flags and its turns from the parsed flags, both in its own module.
    add_arguments: Callable[[argparse.ArgumentParser], None]
    build: Callable[[argparse.Namespace], list[Turn]]
    # Takes --sessions, --rate (Poisson) and --arrivals-from; qa and burst set their own
    # arrival patterns with flags of their own.
    synthetic: bool


ApiWeights = tuple[tuple[Api, float], ...]


def _api_weights(text: str) -> ApiWeights:
    """``--api``: one API name (every session), or ``NAME=WEIGHT,...``."""
    pairs = named_weights(text) if "=" in text else ((text.strip(), 1.0),)
    known: dict[str, Api] = {api: api for api in APIS}
    weights: list[tuple[Api, float]] = []
    for name, weight in pairs:
        api = known.get(name)
        if api is None:
            raise argparse.ArgumentTypeError(f"unknown api {name!r}; known: {', '.join(APIS)}")
        if weight < 0:
            raise argparse.ArgumentTypeError(f"api weights must be >= 0: {text!r}")
        weights.append((api, weight))
    if sum(w for _, w in weights) <= 0:
        raise argparse.ArgumentTypeError(f"api weights must not all be 0: {text!r}")
    return tuple(weights)


def with_apis(turns: list[Turn], weights: ApiWeights, seed: int) -> list[Turn]:
    """``turns`` with each session's API on its turn 0, drawn by ``weights``.

    The draws come from their own generator, one per session in order of first
    appearance, so the rest of the trace is what the same seed gives without ``--api``.
    """
    rng = random.Random(f"api:{seed}")
    names = [api for api, _ in weights]
    shares = [weight for _, weight in weights]
    drawn: dict[str, Api] = {}
    for turn in turns:
        if turn.session not in drawn:
            drawn[turn.session] = rng.choices(names, shares)[0]
    return [replace(t, api=drawn[t.session]) if t.turn == 0 else t for t in turns]


# Each kind's flags and the turns built from them live in its own module
# (``add_arguments``, ``from_args``); the flags every kind shares are added here.
GENERATORS: Final[Mapping[str, Generator]] = MappingProxyType(
    {
        agent.KIND: Generator(
            "coding-agent sessions (~33 turns)", agent.add_arguments, agent.from_args, True
        ),
        chat.KIND: Generator("short chat sessions", chat.add_arguments, chat.from_args, True),
        shared_prompt.KIND: Generator(
            "users sharing a few long system prompts",
            shared_prompt.add_arguments,
            shared_prompt.from_args,
            True,
        ),
        mix.KIND: Generator(
            "a weighted mix of the generated kinds", mix.add_arguments, mix.from_args, True
        ),
        qa.KIND: Generator(
            "multi-user QA: a shared system prompt, a long context per user, fixed rounds",
            qa.add_arguments,
            qa.from_args,
            False,
        ),
        burst.KIND: Generator(
            "groups of N (near-)identical single-turn prompts arriving together",
            burst.add_arguments,
            burst.from_args,
            False,
        ),
        mooncake.KIND: Generator(
            "sessions inferred from a Mooncake FAST'25 trace",
            mooncake.add_arguments,
            mooncake.from_args,
            False,
        ),
        azure.KIND: Generator(
            "single-turn sessions from an Azure LLM 2023 CSV",
            azure.add_arguments,
            azure.from_args,
            False,
        ),
        aiperf_agentic.KIND: Generator(
            "coding-agent sessions from aiperf's 'synthesize agentic-code' dataset.jsonl",
            aiperf_agentic.add_arguments,
            aiperf_agentic.from_args,
            False,
        ),
        subagents.KIND: Generator(
            "coding-agent sessions that spawn subagents (Claude Code's Task tool)",
            subagents.add_arguments,
            subagents.from_args,
            True,
        ),
        agentx.KIND: Generator(
            "Claude Code sessions and subagents from InferenceX AgentX (Weka) traces",
            agentx.add_arguments,
            agentx.from_args,
            False,
        ),
    }
)


def build_trace(kind: str, args: argparse.Namespace) -> list[Turn]:
    """The turns of ``kind`` built from parsed flags, retimed by ``--arrivals-from``,
    each session's API drawn by ``--api``."""
    generator = GENERATORS.get(kind)
    if generator is None:
        raise ValueError(f"unknown workload kind {kind!r}; known: {', '.join(GENERATORS)}")
    turns = generator.build(args)
    arrivals_from: Path | None = getattr(args, "arrivals_from", None)
    if arrivals_from is not None:
        turns = azure.with_arrivals(turns, azure.arrival_offsets(arrivals_from))
    apis: ApiWeights | None = getattr(args, "api", None)
    if apis is not None:
        turns = with_apis(turns, apis, args.seed)
    return turns


def run(args: argparse.Namespace) -> int:
    try:
        turns = build_trace(args.kind, args)
        write_trace(turns, args.output)
    except (OSError, ValueError) as exc:  # TraceFormatError is a ValueError
        print(f"kvrouter bench gen {args.kind}: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {describe(summarize(turns))}")
    return 0


def _add_common(parser: argparse.ArgumentParser, synthetic: bool) -> None:
    parser.add_argument("-o", "--output", type=Path, required=True, help="trace .jsonl to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--api",
        type=_api_weights,
        metavar="API|API=W,...",
        help=f"the API each session's client speaks ({', '.join(APIS)}): one for every "
        "session, or weights each session draws from, e.g. chat=1,responses=1,messages=2 "
        "(default: none named; the replay's --api carries them)",
    )
    if synthetic:
        parser.add_argument("--sessions", type=int, help="number of sessions")
        parser.add_argument("--rate", type=float, help="session arrivals per second (Poisson)")
        parser.add_argument(
            "--arrivals-from",
            type=Path,
            metavar="AZURE_CSV",
            help="start session i at the i-th request time of an Azure LLM 2023 CSV",
        )


def register(sub: argparse._SubParsersAction[Any]) -> None:
    gen = sub.add_parser(
        "gen",
        help="generate a workload trace",
        description="Write a workload trace (JSON lines: one turn a line, sessions with "
        "their think times) that 'kvrouter bench replay' plays, and print its shape.",
    )
    kinds = gen.add_subparsers(dest="kind", required=True, metavar="KIND")
    for name, generator in GENERATORS.items():
        parser = kinds.add_parser(name, help=generator.help, description=generator.help)
        _add_common(parser, generator.synthetic)
        generator.add_arguments(parser)
        parser.set_defaults(func=run)
