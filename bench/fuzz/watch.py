"""What runs beside a fuzz of the engine or Redis side: normal traffic that must keep
being served, and a probe of how long the router's loop stalls.

The traffic is a plain thread with blocking sockets, so it measures the router from
outside whether it runs in this process (the tests) or in its own (``kvrouter bench
fuzz``); the probe is a process of its own (``bench.fuzz.loop_probe``). ``watching`` starts and
stops them without blocking the caller's event loop (which may be the router's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from bench.fuzz.client import RawRequest, describe, send, status_label, violation

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


class NormalTraffic:
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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="normal-traffic", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

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


class LoopProbe:
    """``bench.fuzz.loop_probe`` in a process of its own: the slowest ``/health`` answer is
    the longest the router's event loop was held (plus a loopback round trip)."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._process: subprocess.Popen[str] | None = None
        self.worst_s = 0.0
        self.probes = 0
        self.failures = 0
        self.slow: list[tuple[float, float]] = []  # (wall-clock time, seconds)

    def start(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.fuzz.loop_probe", str(self._port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def stop(self) -> None:
        assert self._process is not None
        out, _ = self._process.communicate(input="", timeout=120)  # closes its stdin
        summary = json.loads(out.splitlines()[-1])
        self.worst_s, self.probes = summary["worst_s"], summary["probes"]
        self.failures = summary["failures"]
        self.slow = [(at, took) for at, took in summary["slow"]]


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
