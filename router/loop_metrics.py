"""``kvrouter_event_loop_tasks``: how many asyncio tasks are alive on the router's loop.

Every request handler, client connection, health round and background loop is a task, so
under steady traffic the count stays within a band set by the concurrency; a count that
keeps climbing is a task nobody awaits or cancels (a leak the soak benchmark looks for).

The count is read when ``/metrics`` is scraped, from the loop the app was built on (the
loop is captured then because a scrape may in principle run off it). It covers every task
on that loop: with several apps on one loop (the tests), each app reports the same count.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

TASKS_METRIC = "kvrouter_event_loop_tasks"


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The loop this code runs on, or None outside one (metrics built by a plain test)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class EventLoopCollector(Collector):
    """Reports the tasks not yet done on ``loop`` (or, without one, on the loop the scrape
    runs on; nothing when there is neither)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._loop = loop

    def collect(self) -> Iterator[GaugeMetricFamily]:
        loop = self._loop or running_loop()
        if loop is None or loop.is_closed():
            return
        yield GaugeMetricFamily(
            TASKS_METRIC,
            "asyncio tasks not yet done on the router's event loop.",
            value=len(asyncio.all_tasks(loop)),
        )
