"""Short chat sessions: a few turns of short questions and medium answers."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from bench.workloads.flags import add_turn_range_arguments, turn_range_values
from bench.workloads.sampling import (
    LogNormal,
    build_session,
    check_population,
    poisson_arrivals,
    session_rng,
)
from bench.workloads.trace import TextBlock, Turn

KIND = "chat"

DEFAULT_SESSIONS = 100
DEFAULT_RATE = 1.0  # sessions/s
DEFAULT_MIN_TURNS = 2
DEFAULT_MAX_TURNS = 8
# Token sizes of the chat system prompts, "chat-sys-<i>": a one-paragraph persona.
DEFAULT_SYSTEM_PROMPTS = (150, 400)
DEFAULT_USER = LogNormal(median=80, sigma=0.9, low=20, high=500)
DEFAULT_OUTPUT = LogNormal(median=300, sigma=0.6, low=100, high=800)
DEFAULT_THINK_TIME_S = LogNormal(median=12.0, sigma=0.5, low=5.0, high=30.0)


@dataclass(frozen=True, slots=True)
class ChatParams:
    """Knobs of the chat generator; turns per session are uniform in [min, max]."""

    sessions: int = DEFAULT_SESSIONS
    rate: float = DEFAULT_RATE
    min_turns: int = DEFAULT_MIN_TURNS
    max_turns: int = DEFAULT_MAX_TURNS
    system_prompts: tuple[int, ...] = DEFAULT_SYSTEM_PROMPTS
    user: LogNormal = DEFAULT_USER
    output: LogNormal = DEFAULT_OUTPUT
    think_time: LogNormal = DEFAULT_THINK_TIME_S

    def __post_init__(self) -> None:
        check_population(self.sessions, self.rate)
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError("need 1 <= min_turns <= max_turns")
        if not self.system_prompts or min(self.system_prompts) < 1:
            raise ValueError("system_prompts needs at least one positive size")


def _session(params: ChatParams, seed: int, index: int, arrival: float) -> list[Turn]:
    rng = session_rng(seed, KIND, index)
    count = rng.randint(params.min_turns, params.max_turns)
    which = rng.randrange(len(params.system_prompts))
    users = [params.user.draw_int(rng) for _ in range(count)]
    outputs = [params.output.draw_int(rng) for _ in range(count)]
    gaps = [params.think_time.draw(rng) for _ in range(count)]
    system = (TextBlock(f"chat-sys-{which}", params.system_prompts[which]),)
    return build_session(f"{KIND}-{index}", arrival, system, users, outputs, gaps)


def generate(params: ChatParams, seed: int) -> list[Turn]:
    """``params.sessions`` chat sessions arriving as a Poisson process."""
    arrivals = poisson_arrivals(seed, KIND, params.rate, params.sessions)
    turns: list[Turn] = []
    for index, arrival in enumerate(arrivals):
        turns.extend(_session(params, seed, index, arrival))
    return turns


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvrouter bench gen chat``'s own flags (``--sessions`` and ``--rate`` are every
    generated kind's, added by ``bench.workloads.cli``)."""
    add_turn_range_arguments(parser)


def params_from(args: argparse.Namespace) -> ChatParams:
    """The defaults with the flags given on the command line."""
    d = ChatParams()
    return replace(
        d,
        **turn_range_values(args, d),
    )


def from_args(args: argparse.Namespace) -> list[Turn]:
    return generate(params_from(args), args.seed)
