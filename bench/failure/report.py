"""The failure bench's figures per run, its table (median (min-max) over rounds) and
its JSON file (``bench/failure/run.py``; the figures are defined in
``bench.failure.figures``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from rich.console import Console
from rich.table import Table

from bench.failure.figures import (
    affected_sessions,
    hit_rate_between,
    next_turns_ttft,
    prefilled,
    reprefilled_tokens,
    turns_after,
)
from bench.replay.result import RequestRecord, RunResult, summarize
from bench.replay.rounds import Spread, pct, secs

if TYPE_CHECKING:
    from bench.failure.run import FailureConfig

WINDOW_S = 60.0  # the fleet's hit rate is read over this long after the kill
NEXT_TURNS = 3  # the affected sessions' turns whose TTFT is read


@dataclass(slots=True)
class Events:
    """When the injection did what, in simulated seconds since the replay started."""

    checkpoint: float | None = None
    checkpoint_blocks: int | None = None  # the engine's answer: cached blocks written
    kill: float | None = None
    replacement_started: float | None = None
    replacement_healthy: float | None = None
    migrated: float | None = None
    moved_tokens: int | None = None  # the router's answer to the migrate
    removed: float | None = None


@dataclass(frozen=True, slots=True)
class RunFigures:
    at: float  # the kill (or where it would have been), simulated seconds
    affected: int  # sessions
    affected_sessions: tuple[str, ...]
    reprefilled: int | None  # beyond the baseline; None: no baseline run
    reprefill_pairs: int
    prefilled_after: int  # the affected sessions' own prefill from the kill on
    next_ttft_p50: float | None
    next_ttft_p99: float | None
    next_turns: int  # successful next turns the TTFTs are over
    hit_rate_after: float | None  # the fleet's, over WINDOW_S from the kill
    hit_rate: float  # the whole run's
    errors: int
    errors_after: int  # failed requests that ended at or after the kill (in flight, or later)
    replacement_serving: float | None  # kill to the replacement serving (restore: migrated)
    events: Events = field(default_factory=Events)


def figures_of(
    result: RunResult,
    events: Events,
    worker: str,
    at: float,
    baseline: Sequence[RequestRecord] | None,
) -> RunFigures:
    """One run's figures; ``worker`` the killed one's router name, ``at`` the kill."""
    records = result.records
    sessions = affected_sessions(records, worker, at)
    ttft = next_turns_ttft(records, sessions, at, NEXT_TURNS)
    reprefill = None if baseline is None else reprefilled_tokens(records, baseline, sessions, at)
    after = turns_after(records, sessions, at)
    serving = events.migrated if events.migrated is not None else events.replacement_healthy
    return RunFigures(
        at=at,
        affected=len(sessions),
        affected_sessions=tuple(sorted(sessions)),
        reprefilled=None if reprefill is None else reprefill.tokens,
        reprefill_pairs=0 if reprefill is None else reprefill.pairs,
        prefilled_after=sum(prefilled(r) for r in after if r.ok),
        next_ttft_p50=ttft.p50,
        next_ttft_p99=ttft.p99,
        next_turns=ttft.requests,
        hit_rate_after=hit_rate_between(records, at, at + WINDOW_S),
        hit_rate=summarize(records, result.meta.duration_s).hit_rate,
        errors=sum(1 for r in records if not r.ok),
        errors_after=sum(1 for r in records if not r.ok and r.start + r.latency_s >= at),
        replacement_serving=None if serving is None or events.kill is None else serving - at,
        events=events,
    )


@dataclass(frozen=True, slots=True)
class Round:
    figures: Mapping[str, RunFigures]  # by scenario
    results: Mapping[str, RunResult]


def _count(v: float) -> str:
    return f"{v:,.0f}"


@dataclass(frozen=True, slots=True)
class Row:
    key: str
    title: str
    value: Callable[[RunFigures], float | None]
    show: Callable[[float], str]


ROWS: tuple[Row, ...] = (
    Row("affected", "affected sessions", lambda f: f.affected, _count),
    Row(
        "reprefilled",
        "re-prefilled tokens vs none",
        lambda f: f.reprefilled,
        _count,
    ),
    Row(
        "prefilled_after",
        "prefilled tokens after the kill",
        lambda f: f.prefilled_after,
        _count,
    ),
    Row(
        "next_ttft_p50",
        f"TTFT p50, next {NEXT_TURNS} turns",
        lambda f: f.next_ttft_p50,
        secs,
    ),
    Row(
        "next_ttft_p99",
        f"TTFT p99, next {NEXT_TURNS} turns",
        lambda f: f.next_ttft_p99,
        secs,
    ),
    Row(
        "hit_rate_after",
        f"fleet hit rate, {WINDOW_S:g} s after",
        lambda f: f.hit_rate_after,
        pct,
    ),
    Row("hit_rate", "fleet hit rate, whole run", lambda f: f.hit_rate, pct),
    Row("errors", "requests failed", lambda f: f.errors, _count),
    Row(
        "replacement_serving",
        "kill to replacement serving",
        lambda f: f.replacement_serving,
        secs,
    ),
)


def spread(rounds: Sequence[Round], scenario: str, row: Row) -> Spread | None:
    values = [
        v
        for r in rounds
        if scenario in r.figures
        for v in [row.value(r.figures[scenario])]
        if v is not None
    ]
    return Spread.of(values)


def _show(s: Spread | None, row: Row) -> str:
    if s is None:
        return "-"
    low, high = row.show(s.low), row.show(s.high)
    return row.show(s.median) if low == high else f"{row.show(s.median)} ({low}-{high})"


def failure_table(rounds: Sequence[Round], scenarios: Sequence[str]) -> Table:
    table = Table(title="a worker killed mid-run: cold restart, restore + migrate, none")
    table.add_column("metric")
    for scenario in scenarios:
        table.add_column(scenario, justify="right")
    for row in ROWS:
        table.add_row(row.title, *(_show(spread(rounds, s, row), row) for s in scenarios))
    return table


def print_table(console: Console, rounds: Sequence[Round], scenarios: Sequence[str]) -> None:
    console.print(failure_table(rounds, scenarios))
    console.print(
        f"median (min-max) over {len(rounds)} round(s), scenarios interleaved within each; "
        "times are simulated seconds. Affected sessions: those whose last request before "
        "the kill went to w0 (in 'none': before the time of the kill); the prefilled "
        "tokens (prompt - cached) and next turns are theirs from the kill on; "
        "re-prefilled: their prefill less the same turns' in 'none'. Fleet hit rate: "
        "cached / prompt tokens of every request. Replacement serving: healthy (cold), "
        "migrated (restore).",
        highlight=False,
    )


def save_report(rounds: Sequence[Round], config: FailureConfig, path: Path) -> None:
    scenarios = list(config.scenarios)
    report: dict[str, Any] = {
        "config": {
            "engines": config.demo.engines,
            "sessions": config.demo.sessions,
            "kv_tokens": config.demo.kv_tokens,
            "time_scale": config.demo.time_scale,
            "policy": config.policy,
            "kill_at": config.kill_at,
            "checkpoint_before": config.checkpoint_before,
            "restart_after": config.restart_delay,
            "window_s": WINDOW_S,
            "next_turns": NEXT_TURNS,
            "time_unit": "simulated seconds",
        },
        "summary": {
            s: {
                row.key: None if (sp := spread(rounds, s, row)) is None else sp.as_dict()
                for row in ROWS
            }
            for s in scenarios
        },
        "rounds": [{s: asdict(f) for s, f in r.figures.items()} for r in rounds],
    }
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
