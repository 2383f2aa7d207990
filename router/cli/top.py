"""``kvrouter top``: a live view of a running router, read from its /metrics.

Per worker: health, circuit, outstanding requests, engine running/waiting, resident
tokens against capacity. For the router: the hit rate three ways, turns by outcome,
lost prefixes by cause, and TTFT p50/p99 for hits and misses over the last interval
(from the histograms' increase between two reads).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from router.cli.help_format import DefaultsHelpFormatter

Labels = tuple[tuple[str, str], ...]


@dataclass
class Snapshot:
    """Samples by name, then by their label set."""

    values: dict[str, dict[Labels, float]] = field(default_factory=lambda: defaultdict(dict))

    @classmethod
    def parse(cls, text: str) -> Snapshot:
        snap = cls()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                snap.values[s.name][tuple(sorted(s.labels.items()))] = s.value
        return snap

    def by(self, name: str, label: str) -> dict[str, float]:
        """Summed by ``label``: for what each router process (or replica) counts of its
        own."""
        out: dict[str, float] = defaultdict(float)
        for labels, value in self.values.get(name, {}).items():
            out[dict(labels).get(label, "")] += value
        return out

    def seen(self, name: str, label: str, worst: bool = False) -> dict[str, float]:
        """The largest value by ``label`` (the smallest with ``worst``): for what every
        process of a ``--processes`` router sees of one worker (its health, capacity,
        the engine's own counts), which a sum would multiply."""
        pick = min if worst else max
        out: dict[str, float] = {}
        for labels, value in self.values.get(name, {}).items():
            key = dict(labels).get(label, "")
            out[key] = pick(out[key], value) if key in out else value
        return out

    def total(self, name: str) -> float:
        return sum(self.values.get(name, {}).values())


def quantile(
    now: Snapshot,
    before: Snapshot | None,
    name: str,
    outcome: str,
    q: float,
    label: str = "outcome",
) -> float | None:
    """A quantile of a histogram's increase since ``before`` (upper bucket bound), of
    the series whose ``label`` is ``outcome``."""

    def buckets(snap: Snapshot | None) -> dict[float, float]:
        found: dict[float, float] = {}
        for labels, value in (snap.values.get(f"{name}_bucket", {}) if snap else {}).items():
            tags = dict(labels)
            if tags.get(label) == outcome:
                found[float(tags["le"])] = value
        return found

    current, previous = buckets(now), buckets(before)
    counts = sorted((le, current[le] - previous.get(le, 0.0)) for le in current)
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return None
    for le, cumulative in counts:
        if cumulative >= q * total:
            return le
    return None


def _pct(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.1%}" if denominator else "-"


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    return "+Inf" if value == float("inf") else f"≤{value:g} s"


def render(now: Snapshot, before: Snapshot | None) -> Group:
    healthy = now.seen("kvrouter_worker_healthy", "worker", worst=True)
    workers = Table(title="workers")
    # Whole names: the other columns wrap before a worker's name is cut.
    longest = max((len(name) for name in healthy), default=6)
    workers.add_column("worker", no_wrap=True, min_width=longest)
    columns = (
        "healthy",
        "circuit",
        "outstanding",
        "held",
        "engine run/wait",
        "resident / capacity",
    )
    for column in columns:
        workers.add_column(column, justify="right")
    circuit = now.seen("kvrouter_worker_circuit_state", "worker")
    outstanding = now.by("kvrouter_worker_outstanding_requests", "worker")
    resident = now.seen("kvrouter_worker_resident_tokens", "worker")
    capacity = now.seen("kvrouter_worker_capacity_tokens", "worker")
    engine = now.seen("kvrouter_worker_engine_running_requests", "worker")
    waiting = now.seen("kvrouter_worker_engine_waiting_requests", "worker")
    held = now.by("kvrouter_queue_held_requests", "worker")
    for name in sorted(healthy):
        workers.add_row(
            name,
            "yes" if healthy[name] else "NO",
            ("closed", "half-open", "open")[int(circuit.get(name, 0))],
            f"{outstanding.get(name, 0):.0f}",
            f"{held.get(name, 0):.0f}",
            f"{engine.get(name, 0):.0f} / {waiting.get(name, 0):.0f}",
            f"{resident.get(name, 0):,.0f} / {capacity.get(name, 0):,.0f} "
            f"({_pct(resident.get(name, 0), capacity.get(name, 0))})",
        )

    prompt = now.total("kvrouter_usage_prompt_tokens_total")
    summary = Table(title="cache and turns")
    summary.add_column("measure")
    summary.add_column("value", justify="right")
    summary.add_row(
        "hit rate, engine-reported", _pct(now.total("kvrouter_engine_cached_tokens_total"), prompt)
    )
    summary.add_row(
        "hit rate, predicted on the chosen worker",
        _pct(
            now.total("kvrouter_predicted_cached_tokens_total"),
            now.total("kvrouter_prompt_tokens_total"),
        ),
    )
    summary.add_row(
        "hit rate, best any worker held",
        _pct(
            now.total("kvrouter_best_cached_tokens_total"),
            now.total("kvrouter_prompt_tokens_total"),
        ),
    )
    for outcome, count in sorted(now.by("kvrouter_turns_total", "outcome").items()):
        summary.add_row(f"turns: {outcome}", f"{count:,.0f}")
    for cause, count in sorted(now.by("kvrouter_lost_prefix_turns_total", "cause").items()):
        summary.add_row(f"lost prefix: {cause}", f"{count:,.0f}")
    ttft = "kvrouter_turn_time_to_first_token_seconds"
    for outcome in ("hit", "partial", "miss"):
        summary.add_row(
            f"TTFT {outcome} p50 / p99 (last interval)",
            f"{_secs(quantile(now, before, ttft, outcome, 0.5))} / "
            f"{_secs(quantile(now, before, ttft, outcome, 0.99))}",
        )
    return Group(workers, summary, _queue(now, before))


def _queue(now: Snapshot, before: Snapshot | None) -> Table:
    queue = Table(title="the router's queue")
    queue.add_column("class")
    for column in ("held", "wait p50 / p99 (last interval)", "shed: reason"):
        queue.add_column(column, justify="right")
    depth = now.by("kvrouter_queue_depth", "priority")
    sheds: dict[str, dict[str, float]] = {}
    for labels, count in now.values.get("kvrouter_queue_sheds_total", {}).items():
        tags = dict(labels)
        if count:
            sheds.setdefault(tags["priority"], {})[tags["reason"]] = count
    wait = "kvrouter_queue_wait_seconds"
    for priority in sorted(depth):
        shed = sheds.get(priority, {})
        queue.add_row(
            priority,
            f"{depth[priority]:.0f}",
            f"{_secs(quantile(now, before, wait, priority, 0.5, 'priority'))} / "
            f"{_secs(quantile(now, before, wait, priority, 0.99, 'priority'))}",
            ", ".join(f"{reason} {n:,.0f}" for reason, n in sorted(shed.items())) or "-",
        )
    return queue


async def _read(http: httpx.AsyncClient, url: str) -> Snapshot:
    response = await http.get(url.rstrip("/") + "/metrics")
    response.raise_for_status()
    return Snapshot.parse(response.text)


async def watch(url: str, interval_s: float, once: bool, console: Console) -> None:
    async with httpx.AsyncClient(timeout=5.0) as http:
        before = None
        now = await _read(http, url)
        if once:
            console.print(render(now, before))
            return
        with Live(render(now, before), console=console, refresh_per_second=2) as live:
            while True:
                await asyncio.sleep(interval_s)
                before, now = now, await _read(http, url)
                live.update(render(now, before))


DEFAULT_URL = "http://127.0.0.1:8000"


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "top",
        help="a live view of a running router",
        description="A live view of a running router, read from its /metrics: workers, "
        "hit rates, turns by outcome, lost prefixes by cause, TTFT of hits and misses.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument(
        "url",
        nargs="?",
        default=os.environ.get("KVROUTER_URL", DEFAULT_URL),
        help="the router's base URL (KVROUTER_URL)",
    )
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between reads")
    parser.add_argument("--once", action="store_true", help="print one view and exit")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        asyncio.run(watch(args.url, args.interval, args.once, Console()))
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        print(f"error: cannot read {args.url}/metrics: {exc}")
        return 1
    except KeyboardInterrupt:
        pass
    return 0
