"""What the workload modules' command-line flags share: argparse value types and the
rule that a flag left out keeps the params' default.

Each workload module owns its flags (``add_arguments``) and turns them into its params
(``params_from``); ``bench.workloads.cli`` adds the flags every kind has and dispatches.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any, TypeVar

from bench.workloads.sampling import LogNormal

_T = TypeVar("_T")


def token_sizes(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated token counts, each >= 1."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts: {text!r}"
        ) from exc
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"token counts must be >= 1: {text!r}")
    return sizes


def named_weights(text: str) -> tuple[tuple[str, float], ...]:
    """An argparse type: ``NAME=WEIGHT,...`` (names are checked by whoever uses them)."""
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


def given(value: _T | None, default: _T) -> _T:
    """A flag's value, or ``default`` when the flag was left out (argparse's None)."""
    return default if value is None else value


def median(dist: LogNormal, median: float | None) -> LogNormal:
    """``dist`` with a new median; the clip range widens to include it if needed."""
    if median is None:
        return dist
    return replace(dist, median=median, low=min(dist.low, median), high=max(dist.high, median))


def add_max_context_argument(parser: argparse.ArgumentParser) -> None:
    """A trace reader's cut: sessions end before a prompt plus reply passes it."""
    parser.add_argument(
        "--max-context-tokens",
        type=int,
        default=0,
        help="end a session before a prompt plus reply passes this (0: no limit)",
    )


def add_turn_range_arguments(parser: argparse.ArgumentParser) -> None:
    """Sessions of a few turns (chat, shared-prompt); read back by
    ``turn_range_values``."""
    parser.add_argument("--min-turns", type=int)
    parser.add_argument("--max-turns", type=int)
    parser.add_argument("--user-tokens-median", type=float)
    parser.add_argument("--output-tokens-median", type=float)


def turn_range_values(args: argparse.Namespace, defaults: Any) -> dict[str, Any]:
    """The fields the generated kinds of a few turns share (``--sessions``, ``--rate`` and
    ``add_turn_range_arguments``'), over ``defaults`` (their params)."""
    return {
        "sessions": given(args.sessions, defaults.sessions),
        "rate": given(args.rate, defaults.rate),
        "min_turns": given(args.min_turns, defaults.min_turns),
        "max_turns": given(args.max_turns, defaults.max_turns),
        "user": median(defaults.user, args.user_tokens_median),
        "output": median(defaults.output, args.output_tokens_median),
    }
