"""``kvrouter bench compare``: runs side by side, and plots of them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from bench.replay.report import print_tables
from bench.replay.result import RunResult, summarize


def run_labels(paths: Sequence[Path], labels: Sequence[str] | None) -> list[str]:
    """The given labels (one per run), else the file stems."""
    if labels:
        if len(labels) != len(paths):
            raise ValueError(f"{len(labels)} labels for {len(paths)} results")
        return list(labels)
    return [path.stem for path in paths]


def compare(
    runs: Sequence[RunResult],
    labels: Sequence[str],
    console: Console,
    plots_dir: Path | None = None,
) -> list[Path]:
    """Print the runs side by side; write the plots if ``plots_dir``; the files written."""
    summaries = [summarize(r.records, r.meta.duration_s, r.meta.slo_ttft_s) for r in runs]
    print_tables(console, summaries, labels)
    if plots_dir is None:
        return []
    from bench.replay.plots import write_plots  # matplotlib: only when drawing

    written = write_plots(runs, labels, plots_dir)
    for path in written:
        console.print(f"wrote {path}", highlight=False, markup=False)
    return written
