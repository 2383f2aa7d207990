"""Repeated runs, reported as what is stable: the median of each figure and its range.

A comparison runs every router once per round, in an order rotated from round to round
so drift on a noisy machine hits each alike; ``Rounds`` collects the runs by label and
``rounds_table`` prints, per figure, ``median (min-max)`` over the rounds. The best run
is never reported on its own.

Beside the unlimited-cache oracle each run is scored against the capacity-aware
reference (``bench.replay.reference``): ``hit / reference`` is the share of what perfect
affinity would have kept with the fleet's real memory.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from bench.replay.result import RunResult, Summary, summarize
from router.observability.queue_metrics import HOLD_REASONS


@dataclass(frozen=True, slots=True)
class ScoredRun:
    """One run's summary and its capacity-aware reference hit rate (None: not known)."""

    summary: Summary
    reference_hit_rate: float | None = None
    # Figures read from the routers after the run (e.g. Redis round trips per request).
    extras: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        result: RunResult,
        reference_hit_rate: float | None = None,
        extras: Mapping[str, float] | None = None,
    ) -> ScoredRun:
        meta = result.meta
        summary = summarize(result.records, meta.duration_s, meta.slo_ttft_s)
        return cls(summary, reference_hit_rate, dict(extras or {}))

    @property
    def of_reference(self) -> float | None:
        if not self.reference_hit_rate:
            return None
        return self.summary.hit_rate / self.reference_hit_rate


@dataclass(frozen=True, slots=True)
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        if not values:
            return None
        return cls(statistics.median(values), min(values), max(values))

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.low, "max": self.high}


def pct(value: float) -> str:
    return f"{value:.1%}"


def secs(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _rate(value: float) -> str:
    return f"{value:,.2f}"


@dataclass(frozen=True, slots=True)
class Figure:
    key: str
    title: str
    value: Callable[[ScoredRun], float | None]
    show: Callable[[float], str]
    higher_is_better: bool


def _held_figure(reason: str) -> Figure:
    key = f"queue_held_{reason}"
    return Figure(
        key,
        f"requests held by the router's queue: {reason}",
        lambda r: r.extras.get(key),
        lambda v: f"{v:.0f}",
        False,
    )


FIGURES: tuple[Figure, ...] = (
    Figure("hit_rate", "hit rate", lambda r: r.summary.hit_rate, pct, True),
    Figure("of_reference", "hit / capacity reference", lambda r: r.of_reference, pct, True),
    Figure("reference_hit_rate", "capacity reference", lambda r: r.reference_hit_rate, pct, True),
    Figure(
        "oracle_hit_rate",
        "oracle (unlimited cache)",
        lambda r: r.summary.oracle_hit_rate,
        pct,
        True,
    ),
    Figure("missed_share", "later turns missed", lambda r: r.summary.missed_share, pct, False),
    Figure("ttft_p50", "TTFT p50", lambda r: r.summary.ttft_p50, secs, False),
    Figure("ttft_p90", "TTFT p90", lambda r: r.summary.ttft_p90, secs, False),
    Figure("ttft_p99", "TTFT p99", lambda r: r.summary.ttft_p99, secs, False),
    Figure(
        "missed_ttft_p99",
        "TTFT p99, missed turns",
        lambda r: r.summary.missed_ttft_p99,
        secs,
        False,
    ),
    Figure(
        "served_ttft_p99",
        "TTFT p99 of the attempts served (retries left out)",
        lambda r: r.summary.served_ttft_p99,
        secs,
        False,
    ),
    Figure(
        "after_tool_ttft_p99",
        "TTFT p99 after a tool call",
        lambda r: r.summary.after_tool_ttft_p99,
        secs,
        False,
    ),
    Figure(
        "goodput_per_s",
        "goodput (turns/s within the TTFT objective)",
        lambda r: r.summary.goodput_per_s,
        _rate,
        True,
    ),
    Figure("requests_per_s", "requests/s", lambda r: r.summary.requests_per_s, _rate, True),
    Figure(
        "output_tokens_per_s",
        "output tokens/s",
        lambda r: r.summary.output_tokens_per_s,
        lambda v: f"{v:,.0f}",
        True,
    ),
    Figure("errors", "errors", lambda r: float(r.summary.errors), lambda v: f"{v:.0f}", False),
    Figure(
        "queue_wait_p99",
        "router queue wait p99 (admitted)",
        lambda r: r.extras.get("queue_wait_p99"),
        secs,
        False,
    ),
    Figure(
        "queue_sheds",
        "requests shed by the router's queue",
        lambda r: r.extras.get("queue_sheds"),
        lambda v: f"{v:.0f}",
        False,
    ),
    *(_held_figure(reason) for reason in HOLD_REASONS),
    Figure(
        "retries",
        "turns sent again (refused: shed, overloaded)",
        lambda r: float(r.summary.retries) if r.summary.retries else None,
        lambda v: f"{v:.0f}",
        False,
    ),
    Figure(
        "sessions_given_up",
        "sessions that gave up",
        lambda r: float(r.summary.sessions_given_up) if r.summary.retries else None,
        lambda v: f"{v:.0f}",
        False,
    ),
    Figure(
        "requests_cov",
        "load CoV, requests",
        lambda r: r.summary.requests_cov,
        lambda v: f"{v:.3f}",
        False,
    ),
    Figure(
        "prefill_cov",
        "load CoV, prefill tokens",
        lambda r: r.summary.prefill_cov,
        lambda v: f"{v:.3f}",
        False,
    ),
    Figure(
        "gpu_hit_share",
        "prompt tokens found on the GPU (engine)",
        lambda r: r.extras.get("gpu_hit_share"),
        pct,
        True,
    ),
    Figure(
        "cpu_hit_share",
        "prompt tokens read back from the CPU tier (engine)",
        lambda r: r.extras.get("cpu_hit_share"),
        pct,
        True,
    ),
    Figure(
        "reloaded_turns",
        "turns that read some back (engine)",
        lambda r: r.extras.get("reloaded_turns"),
        lambda v: f"{v:.0f}",
        True,
    ),
    Figure(
        "reloaded_ttft_p50",
        "their TTFT p50 (engine)",
        lambda r: r.extras.get("reloaded_ttft_p50"),
        secs,
        False,
    ),
    Figure(
        "reloaded_ttft_p99",
        "their TTFT p99 (engine)",
        lambda r: r.extras.get("reloaded_ttft_p99"),
        secs,
        False,
    ),
    Figure(
        "sent_to_cpu_holder",
        "turns sent where the CPU tier held more than the GPU",
        lambda r: r.extras.get("sent_to_cpu_holder"),
        lambda v: f"{v:.0f}",
        True,
    ),
    Figure(
        "agreement",
        "later turns predicted within a block",
        lambda r: r.extras.get("agreement"),
        pct,
        True,
    ),
    Figure(
        "agreement_at_arrival",
        "… within a block of what the engine held at arrival",
        lambda r: r.extras.get("agreement_at_arrival"),
        pct,
        True,
    ),
    Figure(
        "evicted_while_queued",
        "turns evicted from while queued (engine)",
        lambda r: r.extras.get("evicted_while_queued"),
        pct,
        False,
    ),
    Figure(
        "over_predicted",
        "later turns over-predicted",
        lambda r: r.extras.get("over_predicted"),
        pct,
        False,
    ),
    Figure(
        "under_predicted",
        "later turns under-predicted",
        lambda r: r.extras.get("under_predicted"),
        pct,
        False,
    ),
    Figure(
        "router_cpu_per_request",
        "router CPU / request (wall)",
        lambda r: r.extras.get("router_cpu_per_request"),
        lambda v: f"{v * 1000:.2f} ms",
        False,
    ),
    Figure(
        "kv_event_batches_per_request",
        "KV event batches applied / request",
        lambda r: r.extras.get("kv_event_batches_per_request"),
        lambda v: f"{v:.1f}",
        False,
    ),
    Figure(
        "kv_event_lag_p50",
        "KV event lag p50 (wall)",
        lambda r: r.extras.get("kv_event_lag_p50"),
        lambda v: f"{v * 1000:.1f} ms",
        False,
    ),
    Figure(
        "kv_event_lag_p99",
        "KV event lag p99 (wall)",
        lambda r: r.extras.get("kv_event_lag_p99"),
        lambda v: f"{v * 1000:.1f} ms",
        False,
    ),
    Figure(
        "redis_trips",
        "Redis round trips / request",
        lambda r: r.extras.get("redis_trips"),
        lambda v: f"{v:.2f}",
        False,
    ),
    Figure(
        "redis_timeouts",
        "Redis round trips past the bound",
        lambda r: r.extras.get("redis_timeouts"),
        pct,
        False,
    ),
    Figure(
        "redis_wait_before_forwarding",
        "Redis wait before forwarding, mean / request (wall)",
        lambda r: r.extras.get("redis_wait_before_forwarding"),
        lambda v: f"{v * 1e6:,.0f} µs",
        False,
    ),
    Figure(
        "redis_wait_p50",
        "Redis wait p50 / round trip (wall)",
        lambda r: r.extras.get("redis_wait_p50"),
        lambda v: f"{v * 1e6:,.0f} µs",
        False,
    ),
    Figure(
        "redis_wait_p99",
        "Redis wait p99 / round trip (wall)",
        lambda r: r.extras.get("redis_wait_p99"),
        lambda v: f"{v * 1e6:,.0f} µs",
        False,
    ),
)
FIGURE_BY_KEY = {figure.key: figure for figure in FIGURES}


@dataclass(slots=True)
class Rounds:
    """Runs by label, in the order the labels were first seen."""

    runs: dict[str, list[ScoredRun]] = field(default_factory=dict)

    def add(self, label: str, run: ScoredRun) -> None:
        self.runs.setdefault(label, []).append(run)

    @property
    def labels(self) -> list[str]:
        return list(self.runs)

    def spread(self, label: str, figure: Figure) -> Spread | None:
        values = [v for v in map(figure.value, self.runs[label]) if v is not None]
        return Spread.of(values)

    def as_dict(self, figures_shown: Sequence[Figure] = FIGURES) -> dict[str, dict[str, Any]]:
        """Per router: how many rounds, and each figure's median, min and max (None: the
        router has no such figure)."""
        out: dict[str, dict[str, Any]] = {}
        for label, runs in self.runs.items():
            figures: dict[str, Any] = {"rounds": len(runs)}
            for figure in figures_shown:
                spread = self.spread(label, figure)
                figures[figure.key] = None if spread is None else spread.as_dict()
            out[label] = figures
        return out

    def save(self, path: Path) -> None:
        path.write_bytes(orjson.dumps(self.as_dict(), option=orjson.OPT_INDENT_2))


def show_spread(spread: Spread | None, figure: Figure) -> str:
    if spread is None:
        return "-"
    low, high = figure.show(spread.low), figure.show(spread.high)
    if low == high:
        return figure.show(spread.median)
    return f"{figure.show(spread.median)} ({low}-{high})"


def rounds_table(rounds: Rounds, title: str | None = None, width: int | None = None) -> Table:
    """The figures side by side; where one line a cell would be wider than ``width``, each
    median above its range, so a narrow terminal never cuts a figure in two."""
    rows = []
    for figure in FIGURES:
        spreads = [rounds.spread(label, figure) for label in rounds.labels]
        if all(spread is None for spread in spreads):
            continue  # a figure none of these runs has (e.g. Redis's, without replicas)
        rows.append([figure.title, *(show_spread(spread, figure) for spread in spreads)])
    if width is not None and _one_line_width(["metric", *rounds.labels], rows) > width:
        rows = [[row[0], *(cell.replace(" (", "\n(", 1) for cell in row[1:])] for row in rows]
    table = Table(title=title)
    table.add_column("metric")
    for label in rounds.labels:
        table.add_column(label, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def _one_line_width(columns: list[str], rows: list[list[str]]) -> int:
    """A table's width with every cell on one line (3 characters of border a column)."""
    widths = [
        max(len(cell) for cell in [name, *(row[i] for row in rows)])
        for i, name in enumerate(columns)
    ]
    return sum(width + 3 for width in widths) + 1


def print_rounds(console: Console, rounds: Rounds, title: str | None = None) -> None:
    count = max((len(runs) for runs in rounds.runs.values()), default=0)
    console.print(rounds_table(rounds, title, console.width))
    console.print(
        f"median (min-max) over {count} round(s), routers interleaved within each; "
        "times are simulated seconds. Capacity reference: every session pinned to "
        "one worker, each an LRU of its real KV capacity.",
        highlight=False,
    )


def rotated(items: Sequence[Any], round_index: int) -> list[Any]:
    """``items`` starting at ``round_index`` (mod len): each router goes first in turn."""
    if not items:
        return []
    shift = round_index % len(items)
    return [*items[shift:], *items[:shift]]
