"""PNG plots comparing runs: TTFT CDF and hit rate by turn.

Figures are drawn on matplotlib's Agg canvas directly rather than through pyplot, so
nothing touches pyplot's global figure list or the process-wide backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from bench.replay.result import RunResult, summarize

TTFT_CDF_FILE = "ttft_cdf.png"
HIT_BY_TURN_FILE = "hit_rate_by_turn.png"
DPI = 120


def _save(figure: Figure, path: Path) -> Path:
    for axes in figure.axes:
        # A legend with no labelled lines (no successful request) only warns.
        if axes.get_legend_handles_labels()[0]:
            axes.legend()
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=DPI)
    return path


def plot_ttft_cdf(runs: Sequence[RunResult], labels: Sequence[str], path: Path) -> Path:
    figure = Figure(figsize=(7, 4.5), layout="tight")
    axes = figure.add_subplot()
    for run, label in zip(runs, labels, strict=True):
        ttfts = sorted(r.ttft_s for r in run.records if r.ok and r.ttft_s is not None)
        if not ttfts:
            continue
        shares = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        axes.step(ttfts, shares, where="post", label=label)
    axes.set_xscale("log")
    axes.set_xlabel("TTFT (simulated seconds)")
    axes.set_ylabel("share of requests")
    axes.set_ylim(0, 1.02)
    axes.grid(True, which="both", alpha=0.3)
    return _save(figure, path)


def plot_hit_rate_by_turn(runs: Sequence[RunResult], labels: Sequence[str], path: Path) -> Path:
    figure = Figure(figsize=(7, 4.5), layout="tight")
    axes = figure.add_subplot()
    for run, label in zip(runs, labels, strict=True):
        by_turn = summarize(run.records, run.meta.duration_s).by_turn
        turns = [t.turn for t in by_turn]
        line = axes.plot(turns, [t.hit_rate for t in by_turn], marker="o", label=label)[0]
        axes.plot(
            turns,
            [t.oracle_hit_rate for t in by_turn],
            linestyle="--",
            color=line.get_color(),
            alpha=0.6,
            label=f"{label} (oracle)",
        )
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("turn index")
    axes.set_ylabel("token-weighted hit rate")
    axes.set_ylim(0, 1.02)
    axes.grid(True, alpha=0.3)
    return _save(figure, path)


def write_plots(runs: Sequence[RunResult], labels: Sequence[str], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        plot_ttft_cdf(runs, labels, out_dir / TTFT_CDF_FILE),
        plot_hit_rate_by_turn(runs, labels, out_dir / HIT_BY_TURN_FILE),
    ]
