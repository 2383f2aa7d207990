"""Tables of run summaries: one column per run, one row per metric (rich)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.console import Console
from rich.table import Table

from bench.replay.result import MISS_FRACTION, ApiStats, RunResult, Summary, summarize


def _pct(value: float) -> str:
    return f"{value:.1%}"


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _count(value: int) -> str:
    return f"{value:,}"


def _opt_pct(value: float | None) -> str:
    return "-" if value is None else _pct(value)


def _opt_rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


Row = tuple[str, Callable[[Summary], str]]

# Shared by the end-of-run report and `bench compare`, so both read the same.
METRIC_ROWS: tuple[Row, ...] = (
    ("requests", lambda s: _count(s.requests)),
    ("errors", lambda s: _count(s.errors)),
    ("hit rate (token-weighted)", lambda s: _pct(s.hit_rate)),
    ("oracle hit rate", lambda s: _pct(s.oracle_hit_rate)),
    ("prompt tokens", lambda s: _count(s.prompt_tokens)),
    ("cached tokens", lambda s: _count(s.cached_tokens)),
    ("turn-0 requests", lambda s: _count(s.turn0_requests)),
    ("turn-0 below half the oracle", lambda s: _count(s.turn0_missed)),
    ("later turns", lambda s: _count(s.later_requests)),
    ("later turns missed", lambda s: f"{s.missed_turns:,} ({_pct(s.missed_share)})"),
    ("TTFT p50", lambda s: _secs(s.ttft_p50)),
    ("TTFT p90", lambda s: _secs(s.ttft_p90)),
    ("TTFT p99", lambda s: _secs(s.ttft_p99)),
    ("TTFT p50, missed turns", lambda s: _secs(s.missed_ttft_p50)),
    ("TTFT p90, missed turns", lambda s: _secs(s.missed_ttft_p90)),
    ("TTFT p99, missed turns", lambda s: _secs(s.missed_ttft_p99)),
    ("TTFT p99 of the attempts served", lambda s: _secs(s.served_ttft_p99)),
    ("turns after a tool call", lambda s: _count(s.after_tool_requests)),
    ("TTFT p50 after a tool call", lambda s: _secs(s.after_tool_ttft_p50)),
    ("TTFT p99 after a tool call", lambda s: _secs(s.after_tool_ttft_p99)),
    ("latency p50", lambda s: _secs(s.latency_p50)),
    ("latency p99", lambda s: _secs(s.latency_p99)),
    ("duration", lambda s: _secs(s.duration_s)),
    ("requests/s", lambda s: f"{s.requests_per_s:.2f}"),
    ("retries", lambda s: _count(s.retries)),
    ("sessions that gave up", lambda s: _count(s.sessions_given_up)),
    ("turns within the TTFT objective", lambda s: _opt_pct(s.slo_met_share)),
    ("goodput (turns/s within it)", lambda s: _opt_rate(s.goodput_per_s)),
    ("a session's turns within it, median", lambda s: _opt_pct(s.session_slo_met_median)),
    ("output tokens/s", lambda s: f"{s.output_tokens_per_s:,.0f}"),
)

CAPTION = (
    "Times are simulated seconds (wall-clock x time scale). A later turn (turn > 0) "
    f"missed when its cached tokens were under {MISS_FRACTION:.0%} of the oracle's "
    "(a perfect router with unlimited cache)."
)


def summary_table(summaries: Sequence[Summary], labels: Sequence[str]) -> Table:
    table = Table()
    table.add_column("metric")
    for label in labels:
        table.add_column(label, justify="right")
    for name, cell in METRIC_ROWS:
        table.add_row(name, *(cell(s) for s in summaries))
    return table


def by_turn_table(summaries: Sequence[Summary], labels: Sequence[str]) -> Table:
    """Hit rate (and the oracle's) by turn index, one column pair per run."""
    table = Table(title="hit rate by turn (measured / oracle)")
    table.add_column("turn", justify="right")
    for label in labels:
        table.add_column(label, justify="right")
    turns = sorted({t.turn for s in summaries for t in s.by_turn})
    for turn in turns:
        cells = []
        for summary in summaries:
            stats = next((t for t in summary.by_turn if t.turn == turn), None)
            cells.append(
                "-"
                if stats is None
                else f"{_pct(stats.hit_rate)} / {_pct(stats.oracle_hit_rate)} (n={stats.requests})"
            )
        table.add_row(str(turn), *cells)
    return table


def by_api_table(stats: Sequence[ApiStats]) -> Table:
    """One row per API a run used."""
    table = Table(title="by client API")
    table.add_column("api")
    for name in ("requests", "errors", "hit rate", "TTFT p50", "TTFT p99"):
        table.add_column(name, justify="right")
    for s in stats:
        table.add_row(
            s.api,
            _count(s.requests),
            _count(s.errors),
            _pct(s.hit_rate),
            _secs(s.ttft_p50),
            _secs(s.ttft_p99),
        )
    return table


def print_run_report(result: RunResult, console: Console) -> Summary:
    """The end-of-run report; returns the summary it printed."""
    meta = result.meta
    summary = summarize(result.records, meta.duration_s, meta.slo_ttft_s)
    console.print(
        f"replay {meta.trace} -> {meta.target}  default api={meta.api}  model={meta.model}  "
        f"time scale={meta.time_scale:g}  concurrency={meta.concurrency}",
        highlight=False,
        markup=False,
    )
    print_tables(console, [summary], ["result"])
    if summary.by_api:  # more than one API
        console.print(by_api_table(summary.by_api))
    return summary


def print_tables(console: Console, summaries: Sequence[Summary], labels: Sequence[str]) -> None:
    console.print(summary_table(summaries, labels))
    console.print(CAPTION, highlight=False, markup=False)
    console.print(by_turn_table(summaries, labels))
