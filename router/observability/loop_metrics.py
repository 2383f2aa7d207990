"""The router's event loop itself: ``kvrouter_event_loop_tasks``, how many asyncio tasks
are alive on it, and ``LoopLag``, how late it runs its callbacks.

Every request handler, client connection, health round and background loop is a task, so
under steady traffic the count stays within a band set by the concurrency; a count that
keeps climbing is a task nobody awaits or cancels (a leak the soak benchmark looks for).

The count is read when ``/metrics`` is scraped, from the loop the app was built on (the
loop is captured then because a scrape may in principle run off it). It covers every task
on that loop: with several apps on one loop (the tests), each app reports the same count.
"""

from __future__ import annotations

import asyncio
from collections import deque
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


class LoopLag:
    """How late the event loop runs its callbacks. A tick every ``TICK_S`` notes how far
    past its time it ran; a loop busy with other work (a router past what one core
    serves) runs every timer late, so a timeout that fires after such a stall says
    nothing of what it was waiting for: the answer may have sat unread in the socket."""

    TICK_S = 0.05

    def __init__(self) -> None:
        self._late: deque[tuple[float, float]] = deque(maxlen=64)  # (when, how late)
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        if self._handle is None:
            self._schedule(asyncio.get_running_loop())

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def worst_since(self, since: float) -> float:
        """The longest stall (seconds) the loop had between ``since`` (its clock) and now."""
        return max((late for when, late in self._late if when >= since), default=0.0)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due = loop.time() + self.TICK_S
        self._handle = loop.call_at(self._due, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        if now - self._due > self.TICK_S:
            self._late.append((now, now - self._due))
        self._schedule(loop)
