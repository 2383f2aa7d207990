"""Plots of the routing matrix and of knob sweeps: medians with min-max error bars."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from bench.replay.rounds import FIGURE_BY_KEY, Rounds

DPI = 120
MATRIX_FIGURES = ("hit_rate", "ttft_p90", "ttft_p99")


def _save(figure: Figure, path: Path) -> Path:
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=DPI)
    return path


def write_matrix_plots(results: Mapping[str, Rounds], out: Path) -> list[Path]:
    """One grouped bar chart per figure: a group per workload, a bar per router."""
    if not results:
        return []
    labels: list[str] = []
    for rounds in results.values():
        labels += [label for label in rounds.labels if label not in labels]
    rows = list(results)
    written = []
    for key in MATRIX_FIGURES:
        figure_spec = FIGURE_BY_KEY[key]
        figure = Figure(
            figsize=(max(7.0, 1.2 * len(rows) * max(len(labels), 1) / 2), 4.5), layout="tight"
        )
        axes = figure.add_subplot()
        width = 0.8 / max(len(labels), 1)
        for i, label in enumerate(labels):
            xs, medians, low, high = [], [], [], []
            for j, row in enumerate(rows):
                rounds = results[row]
                spread = rounds.spread(label, figure_spec) if label in rounds.runs else None
                if spread is None:
                    continue
                xs.append(j + (i - (len(labels) - 1) / 2) * width)
                medians.append(spread.median)
                low.append(spread.median - spread.low)
                high.append(spread.high - spread.median)
            axes.bar(xs, medians, width, yerr=[low, high], capsize=2, label=label)
        axes.set_xticks(range(len(rows)), rows, rotation=30, ha="right")
        axes.set_ylabel(figure_spec.title + (" (s)" if key.startswith("ttft") else ""))
        if key.startswith("ttft"):
            axes.set_yscale("log")
        axes.set_title(f"{figure_spec.title}: median, bars min-max over rounds")
        axes.legend(fontsize="small")
        written.append(_save(figure, out / f"matrix-{key}.png"))
    return written


def write_sweep_plot(
    knob: str, values: Sequence[float], rounds: Rounds, labels: Sequence[str], path: Path
) -> Path:
    """Hit rate and TTFT p90/p99 against a knob's value (``labels[i]`` ran ``values[i]``)."""
    figure = Figure(figsize=(7, 6), layout="tight")
    hit_axes, ttft_axes = figure.subplots(2, 1, sharex=True)
    for key, axes in (("hit_rate", hit_axes), ("ttft_p90", ttft_axes), ("ttft_p99", ttft_axes)):
        spec = FIGURE_BY_KEY[key]
        spreads = [rounds.spread(label, spec) for label in labels]
        points = [(v, s) for v, s in zip(values, spreads, strict=True) if s is not None]
        axes.errorbar(
            [v for v, _ in points],
            [s.median for _, s in points],
            yerr=[[s.median - s.low for _, s in points], [s.high - s.median for _, s in points]],
            marker="o",
            capsize=3,
            label=spec.title,
        )
    hit_axes.set_ylabel("hit rate")
    ttft_axes.set_ylabel("TTFT (s)")
    ttft_axes.set_xlabel(knob)
    hit_axes.legend(fontsize="small")
    ttft_axes.legend(fontsize="small")
    hit_axes.set_title(f"sweep of {knob}: median, bars min-max over rounds")
    return _save(figure, path)


# The tail as clients felt it, and as the router took it for the requests it admitted.
LOAD_FIGURES = ("goodput_per_s", "hit_rate", "ttft_p99", "served_ttft_p99")


def load_of(name: str) -> tuple[str, float] | None:
    """``("agent", 1.5)`` for a matrix row run at an offered load (``"agent 1.5x"``)."""
    row, _, load = name.rpartition(" ")
    if not row or not load.endswith("x"):
        return None
    try:
        return row, float(load[:-1])
    except ValueError:
        return None


def write_load_plots(results: Mapping[str, Rounds], out: Path) -> list[Path]:
    """Per workload run at several offered loads, one figure per measure against the
    load: a line per router, medians with min-max error bars."""
    by_row: dict[str, list[tuple[float, Rounds]]] = {}
    for name, rounds in results.items():
        found = load_of(name)
        if found is not None:
            by_row.setdefault(found[0], []).append((found[1], rounds))
    written = []
    for row, runs in by_row.items():
        runs.sort(key=lambda run: run[0])
        figure = Figure(figsize=(5.0 * len(LOAD_FIGURES), 4.2), layout="tight")
        for column, key in enumerate(LOAD_FIGURES, start=1):
            spec = FIGURE_BY_KEY[key]
            axes = figure.add_subplot(1, len(LOAD_FIGURES), column)
            labels: list[str] = []
            for _, rounds in runs:
                labels += [label for label in rounds.labels if label not in labels]
            for label in labels:
                points = [
                    (load, spread)
                    for load, rounds in runs
                    if label in rounds.runs and (spread := rounds.spread(label, spec)) is not None
                ]
                if not points:
                    continue
                axes.errorbar(
                    [load for load, _ in points],
                    [s.median for _, s in points],
                    yerr=[
                        [s.median - s.low for _, s in points],
                        [s.high - s.median for _, s in points],
                    ],
                    capsize=3,
                    marker="o",
                    label=label,
                )
            axes.set_xlabel("offered load (x measured capacity)")
            axes.set_ylabel(spec.title + (" (s)" if "ttft" in key else ""))
            axes.set_title(f"{row}: {spec.title}", fontsize="medium")
            axes.legend(fontsize="small")
        written.append(_save(figure, out / f"load-{row}.png"))
    return written
