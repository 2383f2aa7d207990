"""``kvrouter bench real``'s figures: per run from the replay, the router's request log and
its CPU; over the rounds, median and range in a table (console and Markdown) and JSON.

* **hit rate**: cached / prompt tokens over the successful requests, both from the
  engines' own ``usage`` (the replay's records), whichever router passed them on;
* **agreement** (kvrouter only): ``bench.compare.agreement.agreement_of`` on the request-log
  lines, held to one engine block (32 tokens): the share of later turns whose predicted
  cached tokens were within a block of the engine's ``cached_tokens``, and the rest split
  into over- and under-predicted;
* **TTFT p50 / p99**: wall seconds, first content chunk at the client;
* **router CPU / request**: the router process's (and its children's) CPU seconds from
  the start of the replay to its end, over the requests replayed; and the same less what
  the router spends idle (health checks, metric scrapes, timers: its CPU over a quiet
  window before the replay, per second, times the replay's length). On CPU engines a
  run lasts minutes for a few dozen requests, so the idle share is large.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from bench.compare.agreement import agreement_of
from bench.real.vllm_cpu import BLOCK_TOKENS
from bench.replay.rounds import FIGURE_BY_KEY, Figure, Rounds, pct, show_spread


def _titled(key: str, title: str) -> Figure:
    return dataclasses.replace(FIGURE_BY_KEY[key], title=title)


def _ms(value: float) -> str:
    return f"{value * 1000:.2f} ms"


BUSY_CPU = Figure(
    "router_busy_cpu_per_request",
    "… less its idle CPU",
    lambda r: r.extras.get("router_busy_cpu_per_request"),
    _ms,
    False,
)
IDLE_CPU = Figure(
    "router_idle_cpu_share",
    "router CPU idle (of one core)",
    lambda r: r.extras.get("router_idle_cpu_share"),
    pct,
    False,
)


FIGURES: tuple[Figure, ...] = (
    _titled("hit_rate", "hit rate (engines' usage)"),
    _titled("agreement", "agreement: later turns predicted within a block"),
    _titled("over_predicted", "… over-predicted"),
    _titled("under_predicted", "… under-predicted"),
    _titled("ttft_p50", "TTFT p50"),
    _titled("ttft_p99", "TTFT p99"),
    _titled("router_cpu_per_request", "router CPU / request"),
    BUSY_CPU,
    IDLE_CPU,
    _titled("errors", "errors"),
)


@dataclass(frozen=True, slots=True)
class RouterCpu:
    """A router's CPU seconds over a replay of ``wall_s`` seconds, and its CPU seconds
    per second when idle just before."""

    seconds: float
    wall_s: float
    idle_per_s: float

    def busy(self) -> float:
        return max(0.0, self.seconds - self.idle_per_s * self.wall_s)


def run_extras(
    lines: Iterable[Mapping[str, Any]],
    requests: int,
    cpu: RouterCpu | None,
    block: int = BLOCK_TOKENS,
) -> dict[str, float]:
    """One run's figures beside the replay's: the agreement of its request-log
    ``lines`` (none: a router without kvrouter's log) and its CPU per request."""
    extras: dict[str, float] = {}
    scored = agreement_of(lines, block=block)
    if scored.later_turns:
        extras.update(scored.shares())
        extras["later_turns"] = float(scored.later_turns)
    if cpu is not None and requests:
        extras["router_cpu_per_request"] = cpu.seconds / requests
        extras["router_busy_cpu_per_request"] = cpu.busy() / requests
        extras["router_idle_cpu_share"] = cpu.idle_per_s
    return extras


def _cells(rounds: Rounds, figure: Figure) -> list[str]:
    return [show_spread(rounds.spread(label, figure), figure) for label in rounds.labels]


def console_table(rounds: Rounds, title: str | None = None) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    for label in rounds.labels:
        table.add_column(label, justify="right")
    for figure in FIGURES:
        table.add_row(figure.title, *_cells(rounds, figure))
    return table


def markdown_table(rounds: Rounds) -> str:
    """The same rows as ``console_table``, as a Markdown table for docs/."""
    rows = [
        f"| metric | {' | '.join(rounds.labels)} |",
        f"|---|{'---:|' * len(rounds.labels)}",
    ]
    for figure in FIGURES:
        rows.append(f"| {figure.title} | {' | '.join(_cells(rounds, figure))} |")
    return "\n".join(rows) + "\n"


def figures_json(rounds: Rounds) -> dict[str, dict[str, Any]]:
    """Per router: how many rounds, and each of this benchmark's figures' spread."""
    return rounds.as_dict(FIGURES)
