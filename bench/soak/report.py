"""What ``kvrouter bench soak`` found: how every request ended, which failures were losses,
the router's memory, descriptors and tasks over time, and the verdicts; a rich table and
the JSON it is saved as.

A request that failed before its first byte is *lost* unless it overlapped a window in
which no worker could serve (``soak_faults.no_worker_windows``): then the router could
only answer it with an error, and it is counted apart as ``no_worker``.

Growth is judged on medians of the samples in a window (``window_s``) at the end of the
warm-up and at the end of the load, so one sample taken at a burst decides nothing;
descriptors and tasks are also compared idle before the load against idle after it.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from bench.soak.faults import FaultEvent, no_worker_windows
from bench.soak.sample import Sample
from bench.soak.traffic import ENDINGS, Record

RSS_GROWTH_LIMIT = 0.05
MAX_LISTED = 20  # failures listed one by one in the JSON
_LOG_LINE = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+) (?P<name>[\w.]+): (?P<message>.*)$")


@dataclass(frozen=True, slots=True)
class Limits:
    """How much a count of descriptors or tasks may differ between two moments and still
    be no growth: under load, by the requests in flight (one connection and a task or
    two each); idle, by the connections to the engines still pooled."""

    load_slack: int
    idle_slack: int


def _overlaps(record: Record, windows: Sequence[tuple[float, float]]) -> bool:
    return any(record.started <= end and start <= record.ended for start, end in windows)


def _during(record: Record, events: Sequence[FaultEvent], end: float) -> list[str]:
    """The faults under way (started, not yet recovered) while ``record`` ran."""
    return [
        f"{e.kind} {','.join(e.workers)}"
        for e in events
        if e.started <= record.ended
        and record.started <= (e.recovered if e.recovered is not None else end)
    ]


def _failure(record: Record, events: Sequence[FaultEvent], end: float) -> dict[str, Any]:
    return {**record.as_dict(), "during": _during(record, events, end)}


def judge_requests(
    records: Sequence[Record], events: Sequence[FaultEvent], workers: int, end: float
) -> dict[str, Any]:
    windows = no_worker_windows(events, workers, end)
    early = [r for r in records if r.ending == "failed_before_first_byte"]
    lost = [r for r in early if not _overlaps(r, windows)]
    no_worker = [r for r in early if _overlaps(r, windows)]
    late = [r for r in records if r.ending == "failed_after_first_byte"]
    by_shape: dict[str, dict[str, int]] = {}
    for record in records:
        by_shape.setdefault(record.shape, dict.fromkeys(ENDINGS, 0))[record.ending] += 1
    ttfts = sorted(r.ttft_s for r in records if r.ending == "ok" and r.ttft_s is not None)
    return {
        "sent": len(records),
        "by_ending": {e: sum(1 for r in records if r.ending == e) for e in ENDINGS},
        "by_shape": dict(sorted(by_shape.items())),
        "lost_before_first_byte": len(lost),
        "no_worker_could_serve": len(no_worker),
        "no_worker_statuses": dict(Counter(str(r.status) for r in no_worker)),
        "no_worker_windows": [[round(a, 3), round(b, 3)] for a, b in windows],
        "failed_after_first_byte": len(late),
        "ttft_ms_p50": _quantile(ttfts, 0.5),
        "ttft_ms_p99": _quantile(ttfts, 0.99),
        "lost": [_failure(r, events, end) for r in lost],
        "no_worker_examples": [_failure(r, events, end) for r in no_worker[:MAX_LISTED]],
        "after_first_byte_examples": [_failure(r, events, end) for r in late[:MAX_LISTED]],
    }


def _quantile(ordered: Sequence[float], q: float) -> float | None:
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)


def _median(samples: Sequence[Sample], field: str) -> float | None:
    values = [getattr(s, field) for s in samples if getattr(s, field) is not None]
    return statistics.median(values) if values else None


def judge_process(
    samples: Sequence[Sample], warmup_s: float, load_end: float, window_s: float, limits: Limits
) -> tuple[dict[str, Any], dict[str, bool]]:
    """The process's figures, and the checks on them."""
    load = [s for s in samples if s.phase == "load"]
    warm = [s for s in load if warmup_s - window_s <= s.t <= warmup_s] or load[:1]
    last = [s for s in load if s.t >= load_end - window_s] or load[-1:]
    before = [s for s in samples if s.phase == "idle-before"][-1:]
    after = [s for s in samples if s.phase == "idle-after"][-1:]
    figures: dict[str, Any] = {}
    for field in ("rss_bytes", "fds", "tasks"):
        figures[field] = {
            "idle_before": _median(before, field),
            "warm": _median(warm, field),
            "end": _median(last, field),
            "max": max((getattr(s, field) or 0 for s in load), default=None),
            "idle_after": _median(after, field),
        }
    rss = figures["rss_bytes"]
    growth = (rss["end"] - rss["warm"]) / rss["warm"] if rss["warm"] and rss["end"] else None
    figures["rss_growth"] = growth
    # How long after the load the router was back to its idle counts (or gave up).
    figures["settle_s"] = round(after[0].t - load[-1].t, 1) if after and load else None
    checks = {
        "rss_growth_under_5pct": growth is not None and growth < RSS_GROWTH_LIMIT,
        "fds_no_growth": _flat(figures["fds"], limits),
        "tasks_no_growth": _flat(figures["tasks"], limits),
        "load_back_to_zero": bool(after) and after[0].outstanding == 0,
    }
    return figures, checks


def _flat(figure: dict[str, Any], limits: Limits) -> bool:
    """The end of the load no higher than the warm-up's end, idle after no higher than
    idle before, each within its slack."""
    if None in (figure["warm"], figure["end"], figure["idle_before"], figure["idle_after"]):
        return False
    return bool(
        figure["end"] <= figure["warm"] + limits.load_slack
        and figure["idle_after"] <= figure["idle_before"] + limits.idle_slack
    )


def read_log(path: Path) -> dict[str, Any]:
    """Counts by level and the distinct ERROR messages of the router's log."""
    levels: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    tracebacks = 0
    for line in path.read_text(errors="replace").splitlines():
        tracebacks += line.startswith("Traceback")
        found = _LOG_LINE.match(line)
        if found:
            levels[found["level"]] += 1
            if found["level"] in ("ERROR", "CRITICAL"):
                errors[f"{found['name']}: {found['message'][:160]}"] += 1
    return {
        "levels": dict(levels),
        "tracebacks": tracebacks,
        "errors": dict(errors.most_common(MAX_LISTED)),
    }


def faults_summary(events: Sequence[FaultEvent]) -> dict[str, Any]:
    kinds: dict[str, list[FaultEvent]] = {}
    for event in events:
        kinds.setdefault(event.kind, []).append(event)
    return {
        kind: {
            "count": len(found),
            "back_in_rotation_s_median": _seconds(
                [e.recovered - e.lifted for e in found if e.recovered and e.lifted]
            ),
            "not_recovered": sum(1 for e in found if e.recovered is None),
        }
        for kind, found in sorted(kinds.items())
    }


def _seconds(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _mark(ok: bool) -> str:
    return "[green]pass[/green]" if ok else "[red]FAIL[/red]"


def print_summary(console: Console, summary: dict[str, Any]) -> None:
    requests, figures, checks = summary["requests"], summary["process"], summary["checks"]
    table = Table(title=f"kvrouter bench soak: {summary['settings']['duration_s']:g} s")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("", justify="left")
    table.add_row("requests sent", f"{requests['sent']:,}", f"{summary['rate_per_s']:.1f}/s")
    for ending, count in requests["by_ending"].items():
        table.add_row(f"  {ending.replace('_', ' ')}", f"{count:,}", "")
    table.add_row(
        "lost before first byte",
        str(requests["lost_before_first_byte"]),
        _mark(checks["no_lost_requests"]),
    )
    table.add_row(
        "errors while no worker could serve",
        str(requests["no_worker_could_serve"]),
        ", ".join(f"HTTP {s}: {n}" for s, n in requests["no_worker_statuses"].items()),
    )
    table.add_row(
        "TTFT p50 / p99 (ok)", f"{requests['ttft_ms_p50']} / {requests['ttft_ms_p99']} ms", ""
    )
    for kind, fault in summary["faults"].items():
        back = fault["back_in_rotation_s_median"]
        table.add_row(
            f"fault: {kind}",
            str(fault["count"]),
            f"back in {back} s"
            + (f", {fault['not_recovered']} never" if fault["not_recovered"] else ""),
        )
    rss = figures["rss_bytes"]
    growth = figures["rss_growth"]
    table.add_row(
        "router RSS warm-up end → end",
        f"{_mib(rss['warm'])} → {_mib(rss['end'])}",
        ("-" if growth is None else f"{growth:+.1%} ") + _mark(checks["rss_growth_under_5pct"]),
    )
    for field, label, check in (
        ("fds", "open fds", "fds_no_growth"),
        ("tasks", "asyncio tasks", "tasks_no_growth"),
    ):
        f = figures[field]
        table.add_row(
            f"router {label} idle / warm / end / max / idle",
            " / ".join(_count(f[k]) for k in ("idle_before", "warm", "end", "max", "idle_after")),
            _mark(checks[check]),
        )
    table.add_row(
        "router load after the run",
        "0" if checks["load_back_to_zero"] else "not 0",
        f"idle counts after {figures['settle_s']} s " + _mark(checks["load_back_to_zero"]),
    )
    log = summary["router_log"]
    table.add_row(
        "router log ERROR lines / tracebacks",
        f"{log['levels'].get('ERROR', 0)} / {log['tracebacks']}",
        "",
    )
    console.print(table)
    if requests["no_worker_could_serve"]:
        console.print(
            "Errors while no worker could serve: requests that overlapped an outage (every "
            "engine killed) until the router answered /ready again; each got the router's "
            "own error status, none hung.",
            highlight=False,
        )
    console.print("passed" if summary["passed"] else "[red]FAILED[/red]")


def save(summary: dict[str, Any], records: Sequence[Record], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "soak.json"
    path.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    with (out / "records.jsonl").open("wb") as file:
        for record in records:
            file.write(orjson.dumps(record.as_dict()) + b"\n")
    return path
