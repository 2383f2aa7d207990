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
from typing import Any, Final, TypeVar

from bench.replay.api_bodies import APIS, Api
from bench.workloads import agent, azure, burst, chat, mix, mooncake, qa, shared_prompt
from bench.workloads.sampling import LogNormal
from bench.workloads.stats import describe, summarize
from bench.workloads.trace import Turn, write_trace

_T = TypeVar("_T")
_P = TypeVar(
    "_P", agent.AgentParams, chat.ChatParams, shared_prompt.SharedPromptParams, mix.MixParams
)


@dataclass(frozen=True, slots=True)
class Generator:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    build: Callable[[argparse.Namespace], list[Turn]]
    # Takes --sessions, --rate (Poisson) and --arrivals-from; qa and burst set their own
    # arrival patterns with flags of their own.
    synthetic: bool


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts: {text!r}"
        ) from exc
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"token counts must be >= 1: {text!r}")
    return sizes


def _weights(text: str) -> tuple[tuple[str, float], ...]:
    pairs: list[tuple[str, float]] = []
    for part in text.split(","):
        name, sep, value = part.partition("=")
        try:
            pairs.append((name.strip(), float(value)))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected KIND=WEIGHT,...: {text!r}") from exc
        if not sep:
            raise argparse.ArgumentTypeError(f"expected KIND=WEIGHT,...: {text!r}")
    return tuple(pairs)


ApiWeights = tuple[tuple[Api, float], ...]


def _api_weights(text: str) -> ApiWeights:
    """``--api``: one API name (every session), or ``NAME=WEIGHT,...``."""
    pairs = _weights(text) if "=" in text else ((text.strip(), 1.0),)
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


def _median(dist: LogNormal, median: float | None) -> LogNormal:
    """``dist`` with a new median; the clip range widens to include it if needed."""
    if median is None:
        return dist
    return replace(dist, median=median, low=min(dist.low, median), high=max(dist.high, median))


def _given(value: _T | None, default: _T) -> _T:
    return default if value is None else value


def _population(params: _P, args: argparse.Namespace) -> _P:
    """``params`` with the --sessions and --rate given on the command line."""
    return replace(
        params,
        sessions=_given(args.sessions, params.sessions),
        rate=_given(args.rate, params.rate),
    )


def _agent_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns-median", type=float, help="planned turns per session")
    parser.add_argument("--system-prompts", type=_sizes, help="token sizes, e.g. 2500,6000")
    parser.add_argument("--tool-tokens-median", type=float, help="tokens per tool result")
    parser.add_argument("--output-tokens-median", type=float)
    parser.add_argument("--tool-time-median", type=float, help="seconds between turns")
    parser.add_argument("--max-context-tokens", type=int, help="0: no limit")


def _agent(args: argparse.Namespace) -> list[Turn]:
    params = _population(agent.AgentParams(), args)
    params = replace(
        params,
        turns=_median(params.turns, args.turns_median),
        tool_result=_median(params.tool_result, args.tool_tokens_median),
        output=_median(params.output, args.output_tokens_median),
        tool_time=_median(params.tool_time, args.tool_time_median),
    )
    if args.system_prompts is not None:
        params = replace(params, system_prompts=args.system_prompts)
    if args.max_context_tokens is not None:
        params = replace(params, max_context_tokens=args.max_context_tokens)
    return agent.generate(params, args.seed)


def _turn_range_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min-turns", type=int)
    parser.add_argument("--max-turns", type=int)
    parser.add_argument("--user-tokens-median", type=float)
    parser.add_argument("--output-tokens-median", type=float)


_Turned = TypeVar("_Turned", chat.ChatParams, shared_prompt.SharedPromptParams)


def _turn_range(params: _Turned, args: argparse.Namespace) -> _Turned:
    """``params`` with the --sessions/--rate and _turn_range_arguments given."""
    params = _population(params, args)
    return replace(
        params,
        min_turns=_given(args.min_turns, params.min_turns),
        max_turns=_given(args.max_turns, params.max_turns),
        user=_median(params.user, args.user_tokens_median),
        output=_median(params.output, args.output_tokens_median),
    )


def _chat(args: argparse.Namespace) -> list[Turn]:
    return chat.generate(_turn_range(chat.ChatParams(), args), args.seed)


def _shared_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    _turn_range_arguments(parser)
    parser.add_argument("--prompts", type=_sizes, help="token sizes, most popular first")
    parser.add_argument("--zipf", type=float, help="popularity exponent (0: uniform)")


def _shared_prompt(args: argparse.Namespace) -> list[Turn]:
    params = _turn_range(shared_prompt.SharedPromptParams(), args)
    params = replace(
        params,
        prompts=_given(args.prompts, params.prompts),
        zipf_exponent=_given(args.zipf, params.zipf_exponent),
    )
    return shared_prompt.generate(params, args.seed)


def _mix_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weights", type=_weights, help="e.g. agent=1,chat=2,shared-prompt=1")


def _mix(args: argparse.Namespace) -> list[Turn]:
    params = _population(mix.MixParams(), args)
    if args.weights is not None:
        params = replace(params, weights=args.weights)
    return mix.generate(params, args.seed)


def _qa_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--users", type=int, help="one session per user")
    parser.add_argument("--interarrival", type=float, help="seconds between users joining")
    parser.add_argument("--rounds", type=int, help="questions per user")
    parser.add_argument("--system-tokens", type=int, help="the system prompt all users share")
    parser.add_argument("--history-tokens", type=int, help="each user's own context")
    parser.add_argument("--question-tokens-median", type=float)
    parser.add_argument("--output-tokens-median", type=float)
    parser.add_argument("--think-time-median", type=float, help="seconds between rounds")


def _qa(args: argparse.Namespace) -> list[Turn]:
    d = qa.QaParams()
    params = qa.QaParams(
        users=_given(args.users, d.users),
        interarrival_s=_given(args.interarrival, d.interarrival_s),
        rounds=_given(args.rounds, d.rounds),
        system_tokens=_given(args.system_tokens, d.system_tokens),
        history_tokens=_given(args.history_tokens, d.history_tokens),
        question=_median(d.question, args.question_tokens_median),
        output=_median(d.output, args.output_tokens_median),
        think_time=_median(d.think_time, args.think_time_median),
    )
    return qa.generate(params, args.seed)


def _burst_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", type=int, help="number of bursts")
    parser.add_argument("--rate", type=float, help="group arrivals per second (Poisson)")
    parser.add_argument("--group-size", type=int, help="requests per group (the N)")
    parser.add_argument("--prompt-tokens-median", type=float, help="the prompt a group shares")
    parser.add_argument("--near-fraction", type=float, help="groups whose members add a suffix")
    parser.add_argument("--suffix-tokens-median", type=float)
    parser.add_argument("--output-tokens-median", type=float)
    parser.add_argument("--jitter-ms", type=float, help="spread of a group's start times")


def _burst(args: argparse.Namespace) -> list[Turn]:
    d = burst.BurstParams()
    params = burst.BurstParams(
        groups=_given(args.groups, d.groups),
        rate=_given(args.rate, d.rate),
        group_size=_given(args.group_size, d.group_size),
        prompt=_median(d.prompt, args.prompt_tokens_median),
        near_fraction=_given(args.near_fraction, d.near_fraction),
        suffix=_median(d.suffix, args.suffix_tokens_median),
        output=_median(d.output, args.output_tokens_median),
        jitter_s=d.jitter_s if args.jitter_ms is None else args.jitter_ms / 1000,
    )
    return burst.generate(params, args.seed)


def _mooncake_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", type=Path, required=True, help="a Mooncake .jsonl trace")
    parser.add_argument("--max-rows", type=int, help="only the first rows (by timestamp)")
    parser.add_argument("--min-shared-blocks", type=int, default=mooncake.DEFAULT_MIN_SHARED_BLOCKS)
    parser.add_argument("--min-user-tokens", type=int, default=mooncake.DEFAULT_MIN_USER_TOKENS)
    parser.add_argument(
        "--output-in-prompt",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the next prompt contains the previous reply (true of conversation_trace)",
    )


def _mooncake(args: argparse.Namespace) -> list[Turn]:
    params = mooncake.MooncakeParams(
        min_shared_blocks=args.min_shared_blocks,
        min_user_tokens=args.min_user_tokens,
        output_in_prompt=args.output_in_prompt,
        max_rows=args.max_rows,
    )
    return mooncake.load(args.source, params)


def _azure_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", type=Path, required=True, help="an Azure LLM 2023 CSV")
    parser.add_argument("--sessions", type=int, help="only the first N requests")


def _azure(args: argparse.Namespace) -> list[Turn]:
    rows = azure.read_rows(args.source)
    if args.sessions is not None:
        rows = rows[: args.sessions]
    return azure.single_turn_sessions(rows)


GENERATORS: Final[Mapping[str, Generator]] = MappingProxyType(
    {
        agent.KIND: Generator("coding-agent sessions (~33 turns)", _agent_arguments, _agent, True),
        chat.KIND: Generator("short chat sessions", _turn_range_arguments, _chat, True),
        shared_prompt.KIND: Generator(
            "users sharing a few long system prompts",
            _shared_prompt_arguments,
            _shared_prompt,
            True,
        ),
        mix.KIND: Generator("a weighted mix of the generated kinds", _mix_arguments, _mix, True),
        qa.KIND: Generator(
            "multi-user QA: a shared system prompt, a long context per user, fixed rounds",
            _qa_arguments,
            _qa,
            False,
        ),
        burst.KIND: Generator(
            "groups of N (near-)identical single-turn prompts arriving together",
            _burst_arguments,
            _burst,
            False,
        ),
        mooncake.KIND: Generator(
            "sessions inferred from a Mooncake FAST'25 trace",
            _mooncake_arguments,
            _mooncake,
            False,
        ),
        azure.KIND: Generator(
            "single-turn sessions from an Azure LLM 2023 CSV", _azure_arguments, _azure, False
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
    gen = sub.add_parser("gen", help="generate a workload trace", description=__doc__)
    kinds = gen.add_subparsers(dest="kind", required=True, metavar="KIND")
    for name, generator in GENERATORS.items():
        parser = kinds.add_parser(name, help=generator.help, description=generator.help)
        _add_common(parser, generator.synthetic)
        generator.add_arguments(parser)
        parser.set_defaults(func=run)
