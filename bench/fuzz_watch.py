"""What runs beside a fuzz of the engine or Redis side: normal traffic that must keep
being served, and a probe of how long the router's loop stalls.

Both are plain threads with blocking sockets, so they measure the router from outside
whether it runs in this process (the tests) or in its own (``kvrouter bench fuzz``);
``watching`` starts and stops them without blocking the caller's event loop (which may be
the router's).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from bench.fuzz_client import RawRequest, describe, send, status_label, violation

PROBE_EVERY_S = 0.05
SHOWN = 10


@dataclass(slots=True)
class TrafficTally:
    statuses: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    slowest_s: float = 0.0

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())

    @property
    def failed(self) -> int:
        return self.sent - self.statuses.get("200", 0)


class _Watcher:
    """A daemon thread running ``_run`` until ``stop``."""

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        raise NotImplementedError


class NormalTraffic(_Watcher):
    """Well-formed requests, one after another (at most one every ``every_s``), each of
    which must get a 200."""

    def __init__(
        self,
        port: int,
        requests: Callable[[int], RawRequest],
        timeout_s: float = 30.0,
        every_s: float = 0.05,
    ) -> None:
        self._every_s = every_s
        self._port = port
        self._requests = requests
        self._timeout_s = timeout_s
        self.tally = TrafficTally()
        super().__init__("normal-traffic")

    def _run(self) -> None:
        n = 0
        begun = time.monotonic()
        while not self._stop.wait(self._every_s):
            request = self._requests(n)
            n += 1
            started = time.monotonic()
            answer = send("127.0.0.1", self._port, request, self._timeout_s)
            self.tally.slowest_s = max(self.tally.slowest_s, time.monotonic() - started)
            self.tally.statuses[status_label(answer)] += 1
            broken = violation(request, answer) or (
                None if answer.status == 200 else f"status {answer.status}"
            )
            if broken is not None and len(self.tally.violations) < SHOWN:
                self.tally.violations.append(
                    f"{broken} (request {n - 1}, sent {started - begun:.1f} s in): "
                    f"{answer.body[:200]!r} for {describe(request, 120)}"
                )


STALL_LIMIT_S = 1.0  # a /health answer slower than this: the loop was held too long
SLOW_KEPT = 20


class LoopProbe(_Watcher):
    """``GET /health`` every ``PROBE_EVERY_S``: the slowest answer is the longest the
    router's event loop was held (plus a loopback round trip)."""

    def __init__(self, port: int) -> None:
        self._port = port
        self.worst_s = 0.0
        self.probes = 0
        self.failures = 0
        # The first SLOW_KEPT answers over STALL_LIMIT_S: (wall-clock time, seconds), to
        # set beside the router's log and whatever else the machine was doing then.
        self.slow: list[tuple[float, float]] = []
        super().__init__("loop-probe")

    def _run(self) -> None:
        request = RawRequest(b"GET", b"/health", ())
        while not self._stop.wait(PROBE_EVERY_S):
            started = time.monotonic()
            answer = send("127.0.0.1", self._port, request, 60.0)
            took = time.monotonic() - started
            self.worst_s = max(self.worst_s, took)
            if took > STALL_LIMIT_S and len(self.slow) < SLOW_KEPT:
                self.slow.append((time.time() - took, took))
            self.probes += 1
            if answer.status != 200:
                self.failures += 1


@contextlib.asynccontextmanager
async def watching(
    port: int, requests: Callable[[int], RawRequest]
) -> AsyncIterator[tuple[NormalTraffic, LoopProbe]]:
    traffic, probe = NormalTraffic(port, requests), LoopProbe(port)
    traffic.start()
    probe.start()
    try:
        yield traffic, probe
    finally:
        await asyncio.to_thread(traffic.stop)
        await asyncio.to_thread(probe.stop)


def metric_total(page: str, name: str, **labels: str) -> float:
    """The sum of a counter's samples in a /metrics page whose labels include ``labels``."""
    total = 0.0
    for line in page.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        metric, _, label_text = series.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
    return total


def metrics_page(port: int) -> str:
    answer = send("127.0.0.1", port, RawRequest(b"GET", b"/metrics", ()), 30.0)
    return answer.body.decode("utf-8", "replace")
