"""The failure bench's plots over time, one line per scenario (matplotlib's Agg canvas,
as ``bench/replay/plots.py``): the fleet's hit rate per time bucket, and the TTFT of
the affected sessions' turns; a dotted line marks each run's kill."""

from __future__ import annotations

from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from bench.failure.figures import affected_sessions, hit_rate_buckets
from bench.failure.report import Round
from bench.replay.plots import _save

HIT_RATE_FILE = "failure_hit_rate.png"
TTFT_FILE = "failure_affected_ttft.png"
HIT_BUCKET_S = 30.0
TTFT_BUCKET_S = 10.0


def plot_hit_rate(round_: Round, path: Path, width: float = HIT_BUCKET_S) -> Path:
    figure = Figure(figsize=(8, 4.5), layout="tight")
    axes = figure.add_subplot()
    for scenario, result in round_.results.items():
        buckets = hit_rate_buckets(result.records, width, round_.figures[scenario].at)
        points = [(t + width / 2, rate) for t, rate in buckets]
        kept = [(t, rate) for t, rate in points if rate is not None]
        axes.plot([t for t, _ in kept], [r for _, r in kept], marker=".", label=scenario)
    _mark_kill(axes, round_)
    axes.set_xlabel(f"time (simulated seconds; {width:g} s buckets from the kill)")
    axes.set_ylabel("fleet hit rate (cached / prompt tokens)")
    axes.set_ylim(0, 1.02)
    axes.grid(True, alpha=0.3)
    return _save(figure, path)


def plot_affected_ttft(
    round_: Round, worker: str, path: Path, width: float = TTFT_BUCKET_S
) -> Path:
    """Each run's affected sessions (its own: last turn before the kill on ``worker``):
    their turns' TTFT as points, and the bucket means as a line."""
    figure = Figure(figsize=(8, 4.5), layout="tight")
    axes = figure.add_subplot()
    for scenario, result in round_.results.items():
        at = round_.figures[scenario].at
        sessions = affected_sessions(result.records, worker, at)
        points = sorted(
            (r.start, r.ttft_s)
            for r in result.records
            if r.session in sessions and r.ok and r.ttft_s is not None
        )
        if not points:
            continue
        buckets: dict[int, list[float]] = {}
        for start, ttft in points:
            buckets.setdefault(int(start // width), []).append(ttft)
        line = axes.plot(
            [(b + 0.5) * width for b in sorted(buckets)],
            [sum(v) / len(v) for _, v in sorted(buckets.items())],
            label=scenario,
        )[0]
        axes.scatter(
            [s for s, _ in points], [t for _, t in points], s=6, alpha=0.35, color=line.get_color()
        )
    _mark_kill(axes, round_)
    axes.set_yscale("log")
    axes.set_xlabel(f"time (simulated seconds; line: mean over {width:g} s buckets)")
    axes.set_ylabel("TTFT of the affected sessions' turns (s)")
    axes.grid(True, which="both", alpha=0.3)
    return _save(figure, path)


def _mark_kill(axes: Axes, round_: Round) -> None:
    """One mark at the earliest kill: the runs' kills differ by milliseconds."""
    kills = [f.at for f in round_.figures.values()]
    if kills:
        axes.axvline(min(kills), color="black", linestyle=":", linewidth=1, label="kill")


def write_failure_plots(round_: Round, worker: str, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        plot_hit_rate(round_, out_dir / HIT_RATE_FILE),
        plot_affected_ttft(round_, worker, out_dir / TTFT_FILE),
    ]
