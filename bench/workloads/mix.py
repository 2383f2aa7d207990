"""A mix of agent, chat and shared-prompt sessions arriving as one Poisson process.

Each session's kind is drawn by weight; the sessions of a kind are that kind's
generator's own first sessions (same seed), so a mix holds the very sessions the pure
traces would, only retimed. Session ids start with their kind, so they never collide.
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Final

from bench.workloads import agent, chat, shared_prompt
from bench.workloads.flags import given, named_weights
from bench.workloads.sampling import (
    check_population,
    poisson_arrivals,
    sessions_in_order,
    shift_session,
)
from bench.workloads.trace import Turn

KIND = "mix"

DEFAULT_SESSIONS = 200
DEFAULT_RATE = 1.0  # sessions/s, all kinds together
DEFAULT_WEIGHTS = ((agent.KIND, 1.0), (chat.KIND, 2.0), (shared_prompt.KIND, 1.0))


@dataclass(frozen=True, slots=True)
class MixParams:
    """Knobs of the mix; ``sessions`` and ``rate`` of the per-kind params are ignored."""

    sessions: int = DEFAULT_SESSIONS
    rate: float = DEFAULT_RATE
    weights: tuple[tuple[str, float], ...] = DEFAULT_WEIGHTS
    agent_params: agent.AgentParams = field(default_factory=agent.AgentParams)
    chat_params: chat.ChatParams = field(default_factory=chat.ChatParams)
    shared_prompt_params: shared_prompt.SharedPromptParams = field(
        default_factory=shared_prompt.SharedPromptParams
    )

    def __post_init__(self) -> None:
        check_population(self.sessions, self.rate)
        known = set(KINDS)
        for name, weight in self.weights:
            if name not in known:
                raise ValueError(f"unknown kind {name!r} in weights; known: {sorted(known)}")
            if weight < 0:
                raise ValueError(f"weight of {name!r} must be >= 0")
        if not any(weight > 0 for _, weight in self.weights):
            raise ValueError("at least one weight must be > 0")


def _agent(params: MixParams, count: int, seed: int) -> list[Turn]:
    return agent.generate(replace(params.agent_params, sessions=count), seed)


def _chat(params: MixParams, count: int, seed: int) -> list[Turn]:
    return chat.generate(replace(params.chat_params, sessions=count), seed)


def _shared_prompt(params: MixParams, count: int, seed: int) -> list[Turn]:
    return shared_prompt.generate(replace(params.shared_prompt_params, sessions=count), seed)


# The kinds a mix draws from: name -> (params, session count, seed) -> turns.
KINDS: Final[Mapping[str, Callable[[MixParams, int, int], list[Turn]]]] = MappingProxyType(
    {agent.KIND: _agent, chat.KIND: _chat, shared_prompt.KIND: _shared_prompt}
)


def generate(params: MixParams, seed: int) -> list[Turn]:
    """``params.sessions`` sessions of the weighted kinds, arriving at ``params.rate``."""
    names = [name for name, _ in params.weights]
    weights = [weight for _, weight in params.weights]
    kinds = random.Random(f"{KIND}:{seed}:kinds").choices(names, weights=weights, k=params.sessions)
    pending = {
        name: iter(sessions_in_order(KINDS[name](params, count, seed)))
        for name, count in Counter(kinds).items()
    }
    arrivals = poisson_arrivals(seed, KIND, params.rate, params.sessions)
    turns: list[Turn] = []
    for name, arrival in zip(kinds, arrivals, strict=True):
        turns.extend(shift_session(next(pending[name]), arrival))
    return turns


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvrouter bench gen mix``'s own flags (``--sessions`` and ``--rate`` are every
    generated kind's, added by ``bench.workloads.cli``)."""
    parser.add_argument("--weights", type=named_weights, help="e.g. agent=1,chat=2,shared-prompt=1")


def params_from(args: argparse.Namespace) -> MixParams:
    """The defaults with the flags given on the command line."""
    d = MixParams()
    return replace(
        d,
        sessions=given(args.sessions, d.sessions),
        rate=given(args.rate, d.rate),
        weights=given(args.weights, d.weights),
    )


def from_args(args: argparse.Namespace) -> list[Turn]:
    return generate(params_from(args), args.seed)
