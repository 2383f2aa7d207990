"""Many users behind a few long system prompts (apps, RAG templates, few-shot prompts).

The workload where prefix caching matters most: most of each prompt is one of a handful
of long system prompts, chosen with Zipf popularity, and each user adds only a short
conversation of 1-4 turns.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, replace

from bench.workloads.flags import add_turn_range_arguments, given, token_sizes, turn_range_values
from bench.workloads.sampling import (
    LogNormal,
    build_session,
    check_population,
    poisson_arrivals,
    session_rng,
    zipf_weights,
)
from bench.workloads.trace import TextBlock, Turn

KIND = "shared-prompt"

DEFAULT_SESSIONS = 200
DEFAULT_RATE = 2.0  # sessions/s
# Token sizes of the shared prompts "shared-sys-<i>", most popular first.
DEFAULT_PROMPTS = (2048, 4096, 6144, 8192)
DEFAULT_ZIPF_EXPONENT = 1.0
DEFAULT_MIN_TURNS = 1
DEFAULT_MAX_TURNS = 4
DEFAULT_USER = LogNormal(median=150, sigma=0.8, low=20, high=1000)
DEFAULT_OUTPUT = LogNormal(median=200, sigma=0.7, low=20, high=1000)
DEFAULT_THINK_TIME_S = LogNormal(median=10.0, sigma=0.6, low=2.0, high=60.0)


@dataclass(frozen=True, slots=True)
class SharedPromptParams:
    """Knobs of the shared-prompt generator; turns per session are uniform in [min, max]."""

    sessions: int = DEFAULT_SESSIONS
    rate: float = DEFAULT_RATE
    prompts: tuple[int, ...] = DEFAULT_PROMPTS
    zipf_exponent: float = DEFAULT_ZIPF_EXPONENT
    min_turns: int = DEFAULT_MIN_TURNS
    max_turns: int = DEFAULT_MAX_TURNS
    user: LogNormal = DEFAULT_USER
    output: LogNormal = DEFAULT_OUTPUT
    think_time: LogNormal = DEFAULT_THINK_TIME_S

    def __post_init__(self) -> None:
        check_population(self.sessions, self.rate)
        if not self.prompts or min(self.prompts) < 1:
            raise ValueError("prompts needs at least one positive size")
        if self.zipf_exponent < 0:
            raise ValueError("zipf_exponent must be >= 0")
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError("need 1 <= min_turns <= max_turns")


def _session(
    params: SharedPromptParams, seed: int, index: int, arrival: float, weights: list[float]
) -> list[Turn]:
    rng = session_rng(seed, KIND, index)
    which = _pick(rng, weights)
    count = rng.randint(params.min_turns, params.max_turns)
    users = [params.user.draw_int(rng) for _ in range(count)]
    outputs = [params.output.draw_int(rng) for _ in range(count)]
    gaps = [params.think_time.draw(rng) for _ in range(count)]
    system = (TextBlock(f"shared-sys-{which}", params.prompts[which]),)
    return build_session(f"{KIND}-{index}", arrival, system, users, outputs, gaps)


def _pick(rng: random.Random, weights: list[float]) -> int:
    return rng.choices(range(len(weights)), weights=weights)[0]


def generate(params: SharedPromptParams, seed: int) -> list[Turn]:
    """``params.sessions`` sessions arriving as a Poisson process."""
    weights = zipf_weights(len(params.prompts), params.zipf_exponent)
    arrivals = poisson_arrivals(seed, KIND, params.rate, params.sessions)
    turns: list[Turn] = []
    for index, arrival in enumerate(arrivals):
        turns.extend(_session(params, seed, index, arrival, weights))
    return turns


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvrouter bench gen shared-prompt``'s own flags (``--sessions`` and ``--rate`` are
    every generated kind's, added by ``bench.workloads.cli``)."""
    add_turn_range_arguments(parser)
    parser.add_argument("--prompts", type=token_sizes, help="token sizes, most popular first")
    parser.add_argument("--zipf", type=float, help="popularity exponent (0: uniform)")


def params_from(args: argparse.Namespace) -> SharedPromptParams:
    """The defaults with the flags given on the command line."""
    d = SharedPromptParams()
    return replace(
        d,
        **turn_range_values(args, d),
        prompts=given(args.prompts, d.prompts),
        zipf_exponent=given(args.zipf, d.zipf_exponent),
    )


def from_args(args: argparse.Namespace) -> list[Turn]:
    return generate(params_from(args), args.seed)
