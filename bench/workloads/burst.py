"""Bursts of identical or near-identical prompts: best-of-N sampling and RL rollouts.

Requests come in groups of ``group_size`` that send the same prompt at (almost) the same
moment: N samples of one prompt, or the rollouts of one RL problem. A fraction
``near_fraction`` of the groups are near-identical instead: the members share the prompt
and each adds a short suffix of its own (a different few-shot pick, seed or instruction
tail), so they share a prefix and then differ. Groups arrive as a Poisson process of
``rate`` groups/s.

Replay. Every member is its own single-turn session (``burst-<group>-<member>``), so the
session key tells a router nothing about the group: only the prompt does. Sessions start
open-loop at their arrival, so the members of a group go out together: the first at the
group's arrival, the others up to ``jitter_s`` later (0: all at once), so all of them
are in flight while the first one's prefill runs, provided the replay's
``--concurrency`` leaves ``group_size`` free slots (``--max-sessions`` may cut the last
group short). That is the case cache-aware routing must get right: the prompt is cached
nowhere yet, so only the prompt itself, not a session key or a cache hit, can tell the
router to keep the group on one worker, where N-1 members reuse (or wait for) the first
one's prefill instead of prefilling the prompt N times.

Parameter sets: best-of-N is the default; for GRPO-style rollouts use ``--group-size 16
--near-fraction 0 --output-tokens-median 1500``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from bench.workloads.flags import given, median
from bench.workloads.sampling import LogNormal, check_population, poisson_arrivals, session_rng
from bench.workloads.trace import TextBlock, Turn

KIND = "burst"

DEFAULT_GROUPS = 50
DEFAULT_RATE = 0.5  # groups/s
DEFAULT_GROUP_SIZE = 8
DEFAULT_PROMPT = LogNormal(median=4000, sigma=0.3, low=2000, high=8000)
DEFAULT_NEAR_FRACTION = 0.25
DEFAULT_SUFFIX = LogNormal(median=32, sigma=0.5, low=8, high=128)
DEFAULT_OUTPUT = LogNormal(median=500, sigma=0.6, low=50, high=2000)
DEFAULT_JITTER_S = 0.002


@dataclass(frozen=True, slots=True)
class BurstParams:
    """Knobs of the burst generator; token sizes are stand-in tokens.

    The prompt size is drawn once per group, suffix and output sizes once per member.
    """

    groups: int = DEFAULT_GROUPS
    rate: float = DEFAULT_RATE
    group_size: int = DEFAULT_GROUP_SIZE
    prompt: LogNormal = DEFAULT_PROMPT
    near_fraction: float = DEFAULT_NEAR_FRACTION
    suffix: LogNormal = DEFAULT_SUFFIX
    output: LogNormal = DEFAULT_OUTPUT
    jitter_s: float = DEFAULT_JITTER_S

    def __post_init__(self) -> None:
        check_population(self.groups, self.rate)
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if not 0.0 <= self.near_fraction <= 1.0:
            raise ValueError(f"near_fraction must be in [0, 1], got {self.near_fraction}")
        if self.jitter_s < 0:
            raise ValueError(f"jitter_s must be >= 0, got {self.jitter_s}")


def _group(params: BurstParams, seed: int, index: int, arrival: float) -> list[Turn]:
    rng = session_rng(seed, KIND, index)
    prompt = TextBlock(f"{KIND}-{index}/prompt", params.prompt.draw_int(rng))
    near = rng.random() < params.near_fraction
    turns: list[Turn] = []
    for member in range(params.group_size):
        # Draw every value for every member so near_fraction never shifts the stream.
        delay = rng.uniform(0.0, params.jitter_s) if member else 0.0
        suffix_tokens = params.suffix.draw_int(rng)
        output = params.output.draw_int(rng)
        session = f"{KIND}-{index}-{member}"
        suffix = (TextBlock(f"{session}/suffix", suffix_tokens),) if near else ()
        turns.append(Turn(session, 0, arrival + delay, 0.0, (prompt, *suffix), output))
    return turns


def generate(params: BurstParams, seed: int) -> list[Turn]:
    """``params.groups`` groups of ``params.group_size`` single-turn sessions."""
    arrivals = poisson_arrivals(seed, KIND, params.rate, params.groups)
    turns: list[Turn] = []
    for index, arrival in enumerate(arrivals):
        turns.extend(_group(params, seed, index, arrival))
    return turns


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvrouter bench gen burst``'s flags: its ``--rate`` counts groups, not sessions."""
    parser.add_argument("--groups", type=int, help="number of bursts")
    parser.add_argument("--rate", type=float, help="group arrivals per second (Poisson)")
    parser.add_argument("--group-size", type=int, help="requests per group (the N)")
    parser.add_argument("--prompt-tokens-median", type=float, help="the prompt a group shares")
    parser.add_argument("--near-fraction", type=float, help="groups whose members add a suffix")
    parser.add_argument("--suffix-tokens-median", type=float)
    parser.add_argument("--output-tokens-median", type=float)
    parser.add_argument("--jitter-ms", type=float, help="spread of a group's start times")


def params_from(args: argparse.Namespace) -> BurstParams:
    """The defaults with the flags given on the command line."""
    d = BurstParams()
    return BurstParams(
        groups=given(args.groups, d.groups),
        rate=given(args.rate, d.rate),
        group_size=given(args.group_size, d.group_size),
        prompt=median(d.prompt, args.prompt_tokens_median),
        near_fraction=given(args.near_fraction, d.near_fraction),
        suffix=median(d.suffix, args.suffix_tokens_median),
        output=median(d.output, args.output_tokens_median),
        jitter_s=d.jitter_s if args.jitter_ms is None else args.jitter_ms / 1000,
    )


def from_args(args: argparse.Namespace) -> list[Turn]:
    return generate(params_from(args), args.seed)
