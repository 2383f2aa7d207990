"""Multi-user QA: many users behind one system prompt, each asking about a long context.

The shape of the multi-round QA benchmark of vLLM's production stack and LMCache
(``multi-round-qa.py --shared-system-prompt 1000 --user-history-prompt ...
--num-rounds ... --answer-len ...``), the multi-turn cousin of SGLang's
generated-shared-prefix dataset. Every user's first message starts with a long context
of their own (a document, or a chat history carried over), right after the system prompt
every user shares; then come ``rounds`` short questions with medium replies, a think
time apart. Users join at a steady rate, one every ``interarrival_s``, not as a Poisson
process, so the number of users in flight ramps up evenly.

Cache shape: the system prompt is a prefix of every request; the user's context plus the
conversation so far is a prefix only that user's later rounds share, and it is most of
each prompt (~9K of ~10K tokens by default). Keeping a user on the worker that holds
their context saves that prefill every round; spreading users evenly makes the per-user
prefixes compete for each worker's cache.

The defaults (24 users, 8 rounds, 1,000 + 8,000 tokens) correspond to
``multi-round-qa.py --num-users 24 --num-rounds 8 --shared-system-prompt 1000
--user-history-prompt 8000``; its long-history runs are ``--history-tokens 20000
--rounds 10``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from bench.workloads.flags import given, median
from bench.workloads.sampling import LogNormal, build_session, session_rng
from bench.workloads.trace import TextBlock, Turn

KIND = "qa"

DEFAULT_USERS = 24
DEFAULT_INTERARRIVAL_S = 2.0  # one new user every 2 s
DEFAULT_ROUNDS = 8
DEFAULT_SYSTEM_TOKENS = 1000  # "qa-sys", shared by every user
DEFAULT_HISTORY_TOKENS = 8000  # "<session>/history", unique to its user
DEFAULT_QUESTION = LogNormal(median=100, sigma=0.4, low=50, high=200)
DEFAULT_OUTPUT = LogNormal(median=180, sigma=0.3, low=100, high=300)
DEFAULT_THINK_TIME_S = LogNormal(median=10.0, sigma=0.5, low=3.0, high=30.0)


@dataclass(frozen=True, slots=True)
class QaParams:
    """Knobs of the QA generator; token sizes are stand-in tokens.

    User *i* (session ``qa-<i>``) starts at ``i * interarrival_s``; 0 starts everyone at
    once.
    """

    users: int = DEFAULT_USERS
    interarrival_s: float = DEFAULT_INTERARRIVAL_S
    rounds: int = DEFAULT_ROUNDS
    system_tokens: int = DEFAULT_SYSTEM_TOKENS
    history_tokens: int = DEFAULT_HISTORY_TOKENS
    question: LogNormal = DEFAULT_QUESTION
    output: LogNormal = DEFAULT_OUTPUT
    think_time: LogNormal = DEFAULT_THINK_TIME_S

    def __post_init__(self) -> None:
        if self.users < 0:
            raise ValueError(f"users must be >= 0, got {self.users}")
        if self.interarrival_s < 0:
            raise ValueError(f"interarrival_s must be >= 0, got {self.interarrival_s}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.system_tokens < 1 or self.history_tokens < 1:
            raise ValueError("system_tokens and history_tokens must be >= 1")


def _user(params: QaParams, seed: int, index: int) -> list[Turn]:
    rng = session_rng(seed, KIND, index)
    session = f"{KIND}-{index}"
    questions = [params.question.draw_int(rng) for _ in range(params.rounds)]
    outputs = [params.output.draw_int(rng) for _ in range(params.rounds)]
    gaps = [params.think_time.draw(rng) for _ in range(params.rounds)]
    system = (TextBlock(f"{KIND}-sys", params.system_tokens),)
    turns = build_session(session, index * params.interarrival_s, system, questions, outputs, gaps)
    # The user's own context opens their first message, right after the shared prompt.
    history = TextBlock(f"{session}/history", params.history_tokens)
    first = turns[0]
    assert not isinstance(first.user, str)  # build_session gives blocks
    turns[0] = replace(first, user=(history, *first.user))
    return turns


def generate(params: QaParams, seed: int) -> list[Turn]:
    """``params.users`` sessions of ``params.rounds`` turns, joining at a steady rate."""
    turns: list[Turn] = []
    for index in range(params.users):
        turns.extend(_user(params, seed, index))
    return turns


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvrouter bench gen qa``'s flags: users join at a steady rate, so it has no
    ``--sessions`` or ``--rate``."""
    parser.add_argument("--users", type=int, help="one session per user")
    parser.add_argument("--interarrival", type=float, help="seconds between users joining")
    parser.add_argument("--rounds", type=int, help="questions per user")
    parser.add_argument("--system-tokens", type=int, help="the system prompt all users share")
    parser.add_argument("--history-tokens", type=int, help="each user's own context")
    parser.add_argument("--question-tokens-median", type=float)
    parser.add_argument("--output-tokens-median", type=float)
    parser.add_argument("--think-time-median", type=float, help="seconds between rounds")


def params_from(args: argparse.Namespace) -> QaParams:
    """The defaults with the flags given on the command line."""
    d = QaParams()
    return QaParams(
        users=given(args.users, d.users),
        interarrival_s=given(args.interarrival, d.interarrival_s),
        rounds=given(args.rounds, d.rounds),
        system_tokens=given(args.system_tokens, d.system_tokens),
        history_tokens=given(args.history_tokens, d.history_tokens),
        question=median(d.question, args.question_tokens_median),
        output=median(d.output, args.output_tokens_median),
        think_time=median(d.think_time, args.think_time_median),
    )


def from_args(args: argparse.Namespace) -> list[Turn]:
    return generate(params_from(args), args.seed)
