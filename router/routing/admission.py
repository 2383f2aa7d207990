"""Admission control: what happens when every eligible worker is full.

A worker is full when it has ``max_outstanding_per_worker`` requests outstanding (the
router's count or the engine's running + waiting, whichever is larger). When every
eligible worker is full, a request waits in a bounded queue for room, up to
``queue_timeout_s``; if the queue is full it is refused at once with 429, and if the wait
runs out with 503, both with ``Retry-After``. A deliberate policy, instead of piling
requests onto engines until they preempt and thrash. ``max_outstanding_per_worker = 0``
turns it off.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from router.errors import Overloaded, TooManyRequests

# Waiters look again at least this often (engine-reported load changes without notice).
RECHECK_S = 0.05


class Admission:
    def __init__(
        self, max_outstanding_per_worker: int, queue_size: int, queue_timeout_s: float
    ) -> None:
        self.limit = max_outstanding_per_worker
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self.waiting = 0
        self._changed = asyncio.Event()

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    async def wait_for_room(self, has_room: Callable[[], bool]) -> None:
        """Return when ``has_room()``; raise ``TooManyRequests`` / ``Overloaded`` if not."""
        if not self.enabled or has_room():
            return
        if self.waiting >= self.queue_size:
            raise TooManyRequests(
                "every worker is at its limit and the queue is full", self.queue_timeout_s
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.queue_timeout_s
        self.waiting += 1
        try:
            while not has_room():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise Overloaded(
                        f"no worker had room within {self.queue_timeout_s:g} s",
                        self.queue_timeout_s,
                    )
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(remaining, RECHECK_S))
        finally:
            self.waiting -= 1

    def notify(self) -> None:
        """A request finished somewhere: waiters look again now."""
        if self.waiting:
            self._changed.set()
