"""Coding-agent sessions: long, tool-driven conversations over a shared system prompt.

Shaped after published coding-agent traces: a few agent system prompts shared by every
session, a first instruction of a thousand-odd tokens, then one turn per tool call whose
"user" message is the tool result (heavy-tailed: mostly a few hundred to a few thousand
tokens, sometimes a whole file). The model's replies are short. The context reaches
about 80K tokens by turn 30 (median over sessions that get that far).

Calibration (2000 sessions, seeds 0-3; ``tests/bench/test_workloads.py`` checks smaller runs):
a tool-result median of ~700 tokens cannot reach 80K by turn 30 unless
sigma is >= 1.6, which puts a quarter of the results outside 100..5000 tokens; a median
of 1300 with sigma 1.1 gives a median context of 80.2-80.9K at turn 30 with 88% of the
results inside that range. The context limit ends about a third of the sessions early
(those planned past ~45 turns), so the realised median is 31-32 turns against the
planned 33.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from bench.workloads.flags import given, median, token_sizes
from bench.workloads.sampling import (
    LogNormal,
    build_session,
    check_population,
    poisson_arrivals,
    session_rng,
)
from bench.workloads.trace import TextBlock, Turn

KIND = "agent"

DEFAULT_SESSIONS = 100
DEFAULT_RATE = 0.05  # sessions/s: one new agent session every 20 s on average
DEFAULT_TURNS = LogNormal(median=33, sigma=0.6, low=5, high=120)
# Token sizes of the agent system prompts every session picks from, "agent-sys-<i>".
DEFAULT_SYSTEM_PROMPTS = (2500, 3500, 4500, 6000)
DEFAULT_FIRST_USER = LogNormal(median=1200, sigma=0.5, low=500, high=3000)
DEFAULT_TOOL_RESULT = LogNormal(median=1300, sigma=1.1, low=50, high=32000)
DEFAULT_OUTPUT = LogNormal(median=250, sigma=0.8, low=50, high=1500)
DEFAULT_TOOL_TIME_S = LogNormal(median=4.0, sigma=0.8, low=0.2, high=120.0)
# Agents compact or stop near the context limit; 120K leaves room for chat-template
# tokens under a 128K-token model.
DEFAULT_MAX_CONTEXT_TOKENS = 120_000


@dataclass(frozen=True, slots=True)
class AgentParams:
    """Knobs of the agent generator; token sizes are stand-in tokens.

    ``turns`` is the planned number of turns; a session ends early instead of letting
    a prompt plus its reply pass ``max_context_tokens`` (0: no limit).
    """

    sessions: int = DEFAULT_SESSIONS
    rate: float = DEFAULT_RATE
    turns: LogNormal = DEFAULT_TURNS
    system_prompts: tuple[int, ...] = DEFAULT_SYSTEM_PROMPTS
    first_user: LogNormal = DEFAULT_FIRST_USER
    tool_result: LogNormal = DEFAULT_TOOL_RESULT
    output: LogNormal = DEFAULT_OUTPUT
    tool_time: LogNormal = DEFAULT_TOOL_TIME_S
    max_context_tokens: int = DEFAULT_MAX_CONTEXT_TOKENS

    def __post_init__(self) -> None:
        check_population(self.sessions, self.rate)
        if not self.system_prompts or min(self.system_prompts) < 1:
            raise ValueError("system_prompts needs at least one positive size")
        if self.max_context_tokens < 0:
            raise ValueError("max_context_tokens must be >= 0")


def _session(params: AgentParams, seed: int, index: int, arrival: float) -> list[Turn]:
    rng = session_rng(seed, KIND, index)
    planned = params.turns.draw_int(rng)
    which = rng.randrange(len(params.system_prompts))
    system_tokens = params.system_prompts[which]
    context = system_tokens
    users: list[int] = []
    outputs: list[int] = []
    gaps: list[float] = []
    for k in range(planned):
        # Draw all three every turn so a cut-off never shifts the random stream.
        user = (params.first_user if k == 0 else params.tool_result).draw_int(rng)
        output = params.output.draw_int(rng)
        gap = params.tool_time.draw(rng)
        limit = params.max_context_tokens
        if k and limit and context + user + output > limit:
            break
        users.append(user)
        outputs.append(output)
        gaps.append(gap)
        context += user + output
    system = (TextBlock(f"agent-sys-{which}", system_tokens),)
    turns = build_session(f"{KIND}-{index}", arrival, system, users, outputs, gaps)
    # Every reply but the last calls a tool, whose result is the next turn's message.
    return [replace(t, ended_by="tool" if t is not turns[-1] else "user") for t in turns]


def generate(params: AgentParams, seed: int) -> list[Turn]:
    """``params.sessions`` agent sessions arriving as a Poisson process."""
    arrivals = poisson_arrivals(seed, KIND, params.rate, params.sessions)
    turns: list[Turn] = []
    for index, arrival in enumerate(arrivals):
        turns.extend(_session(params, seed, index, arrival))
    return turns


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvrouter bench gen agent``'s own flags (``--sessions`` and ``--rate`` are every
    generated kind's, added by ``bench.workloads.cli``)."""
    parser.add_argument("--turns-median", type=float, help="planned turns per session")
    parser.add_argument("--system-prompts", type=token_sizes, help="token sizes, e.g. 2500,6000")
    parser.add_argument("--tool-tokens-median", type=float, help="tokens per tool result")
    parser.add_argument("--output-tokens-median", type=float)
    parser.add_argument("--tool-time-median", type=float, help="seconds between turns")
    parser.add_argument("--max-context-tokens", type=int, help="0: no limit")


def params_from(args: argparse.Namespace) -> AgentParams:
    """The defaults with the flags given on the command line."""
    d = AgentParams()
    return replace(
        d,
        sessions=given(args.sessions, d.sessions),
        rate=given(args.rate, d.rate),
        turns=median(d.turns, args.turns_median),
        system_prompts=given(args.system_prompts, d.system_prompts),
        tool_result=median(d.tool_result, args.tool_tokens_median),
        output=median(d.output, args.output_tokens_median),
        tool_time=median(d.tool_time, args.tool_time_median),
        max_context_tokens=given(args.max_context_tokens, d.max_context_tokens),
    )


def from_args(args: argparse.Namespace) -> list[Turn]:
    return generate(params_from(args), args.seed)
