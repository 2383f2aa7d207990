"""The one clock durations are measured on.

``monotonic()`` is ``time.monotonic()``, except inside an event loop that keeps virtual
time (one marked ``virtual_time = True``: the benchmarks' in-process mode, where
router, engines and clients share a loop whose clock jumps to the next timer when all
are idle); there it is that loop's clock, so every duration is measured in the same
virtual seconds the timers run on. A real loop's own ``time()`` is not used: uvloop's
is cached per iteration at millisecond resolution.
"""

from __future__ import annotations

import asyncio
import time


def monotonic() -> float:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return time.monotonic()
    if getattr(loop, "virtual_time", False):
        return loop.time()
    return time.monotonic()
