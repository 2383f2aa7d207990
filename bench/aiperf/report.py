"""``kvrouter bench aiperf``'s figures: per round, aiperf's own TTFT percentiles beside
what the router's ``/metrics`` counted over the round (the increase of its counters
between a read before aiperf starts and one after it exits); over the rounds, the median
and range of each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich.table import Table

from bench.aiperf.export import AiperfRecord, TtftPercentiles
from bench.replay.rounds import Spread
from bench.soak.sample import Series, total
from router.wire.sessions import SESSION_AFFINITY_HEADER

AFFINITY_SOURCE = f"header:{SESSION_AFFINITY_HEADER}"  # the label of aiperf's session key


@dataclass(frozen=True, slots=True)
class RouterCounts:
    """What the router counted over a round (None: it did not expose the counter)."""

    engine_cached_tokens: float | None
    usage_prompt_tokens: float | None
    affinity_keyed: float | None  # requests whose session key came from X-Session-Affinity

    @classmethod
    def between(cls, before: Series | None, after: Series | None) -> RouterCounts:
        def increase(name: str, **labels: str) -> float | None:
            if before is None or after is None:
                return None
            if not any(n == name for n, _, _ in after):
                return None
            return total(after, name, **labels) - total(before, name, **labels)

        return cls(
            increase("kvrouter_engine_cached_tokens_total"),
            increase("kvrouter_usage_prompt_tokens_total"),
            increase("kvrouter_session_keys_total", source=AFFINITY_SOURCE),
        )

    @property
    def hit_rate(self) -> float | None:
        """Cached over prompt tokens, as the engines reported them through the router."""
        if self.engine_cached_tokens is None or not self.usage_prompt_tokens:
            return None
        return self.engine_cached_tokens / self.usage_prompt_tokens


@dataclass(frozen=True, slots=True)
class RoundFigures:
    round: int
    requests: int  # aiperf's records
    errors: int
    ttft: TtftPercentiles
    router: RouterCounts

    @classmethod
    def of(
        cls,
        round_number: int,
        records: Sequence[AiperfRecord],
        ttft: TtftPercentiles,
        router: RouterCounts,
    ) -> RoundFigures:
        errors = sum(1 for r in records if r.error is not None)
        return cls(round_number, len(records), errors, ttft, router)


Show = Callable[[float], str]


def _ms(value: float) -> str:
    return f"{value:,.1f}"


def _pct(value: float) -> str:
    return f"{value:.1%}"


def _count(value: float) -> str:
    return f"{value:,.0f}"


def _spread(values: Sequence[float | None], show: Show) -> str:
    """``median (min-max)`` of the values known."""
    spread = Spread.of([v for v in values if v is not None])
    if spread is None:
        return "n/a"
    return f"{show(spread.median)} ({show(spread.low)}-{show(spread.high)})"


# Each row of the table: its title, how a value is shown, and the value of a round.
ROWS: tuple[tuple[str, Show, Callable[[RoundFigures], float | None]], ...] = (
    ("requests", _count, lambda r: r.requests),
    ("errors", _count, lambda r: r.errors),
    ("TTFT p50 (ms)", _ms, lambda r: r.ttft.p50_ms),
    ("TTFT p90 (ms)", _ms, lambda r: r.ttft.p90_ms),
    ("TTFT p99 (ms)", _ms, lambda r: r.ttft.p99_ms),
    ("hit rate", _pct, lambda r: r.router.hit_rate),
    ("keyed by X-Session-Affinity", _count, lambda r: r.router.affinity_keyed),
)


def rounds_table(rounds: Sequence[RoundFigures], title: str) -> Table:
    """A row per figure, a column per round, then the median (min-max) over them."""
    table = Table(title=title)
    table.add_column("")
    for r in rounds:
        table.add_column(f"round {r.round}", justify="right")
    if len(rounds) > 1:
        table.add_column("median (min-max)", justify="right")
    for name, show, value in ROWS:
        values = [value(r) for r in rounds]
        cells = ["n/a" if v is None else show(v) for v in values]
        if len(rounds) > 1:
            cells.append(_spread(values, show))
        table.add_row(name, *cells)
    return table
