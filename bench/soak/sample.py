"""What the soak benchmark reads of the router process over time: its resident memory and
open file descriptors from ``/proc``, its asyncio task count and load from its own
``/metrics`` (``kvrouter_event_loop_tasks``, ``kvrouter_worker_outstanding_requests``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.proc_memory import PROC, rss_bytes
from router.observability.loop_metrics import TASKS_METRIC

OUTSTANDING_METRIC = "kvrouter_worker_outstanding_requests"
Series = list[tuple[str, dict[str, str], float]]


def open_fds(pid: int, proc: Path = PROC) -> int:
    return sum(1 for _ in (proc / str(pid) / "fd").iterdir())


def parse_metrics(text: str) -> Series:
    return [
        (s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
    ]


def total(series: Series, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for n, lab, v in series if n == name and labels.items() <= lab.items())


async def scrape(http: aiohttp.ClientSession, router_url: str) -> Series:
    async with http.get(router_url + "/metrics") as response:
        response.raise_for_status()
        return parse_metrics(await response.text())


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # seconds since the run started
    phase: str  # "idle-before", "load", "idle-after"
    rss_bytes: int
    fds: int
    tasks: int | None  # None: the scrape failed
    outstanding: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def take(
    pid: int, http: aiohttp.ClientSession, router_url: str, clock: Callable[[], float], phase: str
) -> Sample:
    """One reading; ``/proc`` first, so the scrape's own connection is not in the count
    (the sampler's session keeps one connection open, which is in every count)."""
    at, rss, fds = clock(), rss_bytes(pid), open_fds(pid)
    try:
        series = await scrape(http, router_url)
    except (aiohttp.ClientError, TimeoutError):
        return Sample(at, phase, rss, fds, None, None)
    return Sample(
        at,
        phase,
        rss,
        fds,
        int(total(series, TASKS_METRIC)),
        int(total(series, OUTSTANDING_METRIC)),
    )


async def sample_until(
    pid: int,
    http: aiohttp.ClientSession,
    router_url: str,
    clock: Callable[[], float],
    every_s: float,
    stop: asyncio.Event,
    samples: list[Sample],
) -> None:
    """A ``load`` sample every ``every_s`` until ``stop`` is set."""
    while not stop.is_set():
        samples.append(await take(pid, http, router_url, clock, "load"))
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            continue
