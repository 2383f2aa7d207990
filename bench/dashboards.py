"""Render Grafana dashboards' panels from a Prometheus, as PNGs, with matplotlib.

Reads each dashboard JSON in ``deploy/grafana/``, runs every panel's queries over a
time range through Prometheus's ``query_range`` API, and draws one figure per dashboard
with the panels on the dashboard's own grid order. It shows what an operator would see,
without a Grafana.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DASHBOARDS = Path(__file__).resolve().parents[1] / "deploy" / "grafana"


def _legend(template: str, labels: dict[str, str]) -> str:
    text = template
    for key, value in labels.items():
        text = text.replace("{{" + key + "}}", value)
    return text or ", ".join(f"{k}={v}" for k, v in labels.items() if k != "__name__") or "value"


async def _series(
    http: aiohttp.ClientSession, prometheus: str, expr: str, start: float, end: float, step: float
) -> list[dict[str, Any]]:
    params = {"query": expr, "start": str(start), "end": str(end), "step": str(step)}
    async with http.get(prometheus.rstrip("/") + "/api/v1/query_range", params=params) as response:
        body = await response.json()
    result: list[dict[str, Any]] = body.get("data", {}).get("result", [])
    return result


async def render_dashboard(
    http: aiohttp.ClientSession,
    prometheus: str,
    dashboard: dict[str, Any],
    start: float,
    end: float,
) -> Figure:
    panels = sorted(dashboard["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    columns = 2
    rows = math.ceil(len(panels) / columns)
    from matplotlib.figure import Figure  # only when drawing: matplotlib is slow to import

    figure = Figure(figsize=(14, 3.2 * rows), layout="constrained")
    step = max(1.0, (end - start) / 200)
    for i, panel in enumerate(panels):
        axes = figure.add_subplot(rows, columns, i + 1)
        axes.set_title(panel["title"], fontsize=10)
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        drawn = 0
        for target in panel["targets"]:
            for series in await _series(http, prometheus, target["expr"], start, end, step):
                points = [
                    (float(t) - start, float(v))
                    for t, v in series["values"]
                    if v not in ("NaN", "+Inf", "-Inf")
                ]
                if not points:
                    continue
                xs, ys = zip(*points, strict=True)
                if unit == "percentunit":
                    ys = tuple(100 * y for y in ys)
                axes.plot(
                    xs,
                    ys,
                    marker=".",
                    markersize=3,
                    label=_legend(target.get("legendFormat", ""), series["metric"]),
                )
                drawn += 1
        axes.set_xlabel("seconds", fontsize=8)
        axes.set_ylabel(
            {"percentunit": "%", "s": "seconds", "reqps": "req/s"}.get(unit, ""), fontsize=8
        )
        axes.tick_params(labelsize=7)
        axes.grid(alpha=0.3)
        if drawn:
            axes.legend(fontsize=6, loc="best")
        else:
            axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes)
    figure.suptitle(dashboard["title"])
    return figure


async def render_all(prometheus: str, start: float, end: float, out_dir: Path) -> list[Path]:
    """One PNG per dashboard in ``out_dir``; the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before any I/O
    written = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        for path in sorted(DASHBOARDS.glob("*.json")):
            dashboard = json.loads(path.read_text())
            figure = await render_dashboard(http, prometheus, dashboard, start, end)
            target = out_dir / f"{path.stem}.png"
            figure.savefig(target, dpi=90)
            written.append(target)
    return written


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser("dashboards", help="render the Grafana dashboards to PNG")
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=15.0, help="time range, ending now")
    parser.add_argument("-o", "--out", type=Path, default=Path("results/dashboards"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    end = time.time()
    for path in asyncio.run(render_all(args.prometheus, end - args.minutes * 60, end, args.out)):
        print(f"wrote {path}")
    return 0
