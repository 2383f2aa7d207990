"""``python -m bench.fuzz.loop_probe PORT``: ``GET /health`` on the router every
``PROBE_EVERY_S`` until its stdin closes, then one JSON line: probes, failures, the
slowest answer and the first ``SLOW_KEPT`` answers over ``STALL_LIMIT_S`` with their
wall-clock time.

A process of its own: in the fuzz harness's process the probe measured the harness's
waits as well as the router's (its generator and hostile engine hold the GIL for seconds
together late in a long run), and reported stalls of 3.5 s where a probe beside it, in
its own process, saw 0.21 s at most.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from bench.fuzz.client import RawRequest, send

PROBE_EVERY_S = 0.05
STALL_LIMIT_S = 1.0  # a /health answer slower than this: the loop was held too long
SLOW_KEPT = 20


def probe(port: int, stop: threading.Event) -> dict[str, object]:
    request = RawRequest(b"GET", b"/health", ())
    worst_s, probes, failures = 0.0, 0, 0
    slow: list[tuple[float, float]] = []
    while not stop.wait(PROBE_EVERY_S):
        started = time.monotonic()
        answer = send("127.0.0.1", port, request, 60.0)
        took = time.monotonic() - started
        worst_s = max(worst_s, took)
        if took > STALL_LIMIT_S and len(slow) < SLOW_KEPT:
            slow.append((time.time() - took, took))
        probes += 1
        if answer.status != 200:
            failures += 1
    return {"probes": probes, "failures": failures, "worst_s": worst_s, "slow": slow}


def main() -> None:
    stop = threading.Event()

    def until_stdin_closes() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    print(json.dumps(probe(int(sys.argv[1]), stop)), flush=True)


if __name__ == "__main__":
    main()
