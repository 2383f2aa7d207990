"""``kvrouter bench fuzz --side engine`` and ``--side redis``: the long runs.

The router is a ``kvrouter serve`` process of its own (its RSS is its own), with a config
file written here; normal traffic and a ``/health`` probe run beside the cases
(``bench.fuzz.watch``). Printed per side: cases and what they aimed at, the router's
answers, property violations with examples, the normal traffic's statuses, the worst
``/health`` stall, RSS after warm-up and at the end, the router's counts of what it
refused, and whether the router logged a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from bench.compare.demo import stop_process
from bench.compare.replicas import redis_server
from bench.cost.tokenize import qwen3_dir
from bench.fuzz.client import NO_ANSWER, Answer, normal_chat
from bench.fuzz.engine_side import HOSTILE_MODEL, EngineTally, play_numbered
from bench.fuzz.hostile_process import hostile_engine_process
from bench.fuzz.loop_probe import STALL_LIMIT_S
from bench.fuzz.redis_side import RedisWriter, session_turn
from bench.fuzz.watch import metric_total, metrics_page, watching
from bench.ports import free_port_run, port_for_later
from bench.proc_memory import rss_kib
from bench.sim.fleet import fleet, wait_healthy

API_KEY = "fuzz-key"
MODEL = "fuzz-model"
NAMESPACE = "kvrouter"
ENGINE_FLAGS = ("--kv-tokens", "50000", "--time-scale", "1000", "--served-model-name", MODEL)
RSS_GROWTH_LIMIT = 0.10
SAMPLE_EVERY = 5_000
# What the router logs of its own failures: a traceback under any of these.
TRACEBACK = "Traceback (most recent call last)"
# The router's counts of what it refused from the fuzzed side, as printed.
Counts = tuple[tuple[str, dict[str, str]], ...]
ENGINE_COUNTS: Counts = (
    ("kvrouter_engine_usage_rejected_total", {}),
    ("kvrouter_kv_event_resets_total", {"reason": "malformed"}),
    ("kvrouter_kv_event_gaps_total", {}),
    ("kvrouter_worker_reads_refused_total", {"what": "metrics"}),
    ("kvrouter_worker_reads_refused_total", {"what": "capacity"}),
    ("kvrouter_requests_total", {"outcome": "upstream_error"}),
    ("kvrouter_requests_total", {"outcome": "timeout"}),
)
REDIS_COUNTS: Counts = (
    *(
        ("kvrouter_redis_bad_entries_total", {"kind": kind})
        for kind in ("load", "rate", "stream", "residency", "replica", "type")
    ),
    ("kvrouter_redis_loop_failures_total", {}),
    ("kvrouter_redis_resyncs_total", {}),
)


@dataclass(slots=True)
class SideRun:
    side: str
    cases: int = 0
    rss_kib: list[tuple[int, int]] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    violations: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    aimed: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)


@contextlib.asynccontextmanager
async def router_process(
    config: dict[str, Any], port: int, log: IO[bytes], workdir: Path
) -> AsyncIterator[asyncio.subprocess.Process]:
    path = workdir / "router.yaml"
    path.write_bytes(orjson.dumps(config))  # JSON is YAML
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.cli",
        "--log-level",
        "WARNING",
        "serve",
        "--config",
        str(path),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=log,
    )
    try:
        await wait_healthy([f"http://127.0.0.1:{port}"], timeout_s=120)
        yield process
    finally:
        await stop_process(process)


def _common(port: int) -> dict[str, Any]:
    return {
        "host": "127.0.0.1",
        "port": port,
        "api_keys": [API_KEY],
        "seed": 1,
        "upstream": {
            "connect_timeout_s": 1.0,
            "read_timeout_s": 1.0,
            "first_byte_timeout_s": 1.0,
            "retry_deadline_s": 2.0,
        },
    }


def _drive(examples: int, seed: int, strategy: Any, one: Callable[[Any], None]) -> None:
    """``one`` on ``examples`` draws of ``strategy`` from ``seed`` (blocking: a thread)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @fixed_seed(seed)
    @given(strategy)
    def run(case: Any) -> None:
        one(case)

    run()


def _sampler(run: SideRun, pid: int, warmup: int) -> Callable[[], None]:
    def sample() -> None:
        run.cases += 1
        if run.cases == warmup or run.cases % SAMPLE_EVERY == 0:
            rss = rss_kib(pid)
            if rss is not None:
                run.rss_kib.append((run.cases, rss))
                # As it goes: a run cut short still says how far it got.
                print(f"{run.cases} cases, RSS {rss / 1024:.0f} MiB", flush=True)

    return sample


async def engine_side(args: argparse.Namespace, workdir: Path, log: IO[bytes]) -> SideRun:
    from bench.fuzz.engine_inputs import EngineCase, engine_cases

    run = SideRun("engine")
    port = args.port or port_for_later()
    model_dir = args.model_dir or qwen3_dir()
    async with (
        hostile_engine_process(HOSTILE_MODEL) as hostile,
        fleet(1, "127.0.0.1", port_for_later(), ENGINE_FLAGS) as engines,
    ):
        config = _common(port) | {
            "workers": [
                {
                    "url": hostile.url,
                    "name": "hostile",
                    "kv_events": {
                        "endpoint": hostile.kv_endpoint,
                        "replay_endpoint": hostile.replay_endpoint,
                    },
                },
                {"url": engines[0].url, "name": "normal"},
            ],
            # Small enough to fill during the warm-up: what grows after it is not a cache.
            "prefix": {"tokenizer": str(model_dir), "tokenizer_cache_tokens": 1_000_000},
            "health": {
                "interval_s": 0.5,
                "timeout_s": 1.0,
                "scrape_interval_s": 0.1,
                "stale_after_s": 5.0,
                "failure_threshold": 1_000_000_000,
            },
        }
        async with router_process(config, port, log, workdir) as router:
            tally = EngineTally()
            sample = _sampler(run, router.pid, args.warmup)
            lock = threading.Lock()
            slots = threading.Semaphore(args.concurrency)
            pool = ThreadPoolExecutor(args.concurrency)
            numbers = itertools.count()

            def play(number: int, case: EngineCase) -> None:
                try:
                    answer, broken = play_numbered(
                        hostile, port, API_KEY, number, case, args.timeout
                    )
                except Exception as exc:  # the harness's own failure: counted, not lost
                    answer, broken = Answer(NO_ANSWER, "", b""), f"harness: {exc!r}"
                try:
                    with lock:
                        tally.record(case, answer, broken)
                        sample()
                finally:
                    slots.release()

            def one(case: EngineCase) -> None:  # generated here, played by the pool
                slots.acquire()
                pool.submit(play, next(numbers), case)

            async with watching(port, lambda _: normal_chat(API_KEY, MODEL)) as (normal, probe):
                await asyncio.to_thread(_drive, args.examples, args.seed, engine_cases(), one)
                await asyncio.to_thread(pool.shutdown)
            page = await asyncio.to_thread(metrics_page, port)
            _finish(run, router.pid, normal, probe, page, ENGINE_COUNTS)
        hostile_counts = await asyncio.to_thread(hostile.counts)
    run.statuses, run.examples = tally.statuses, tally.examples
    run.violations.update(tally.violations)
    run.aimed = tally.labels
    replies = hostile_counts["replies_sent"]
    if replies < run.cases:
        run.violations["cases that never reached the engine"] += run.cases - replies
    run.notes.append(
        f"hostile engine: {replies} replies, {hostile_counts['scrapes']} scrapes, "
        f"{hostile_counts['published']} KV messages, {hostile_counts['replays']} replays"
    )
    return run


async def redis_side(args: argparse.Namespace, workdir: Path, log: IO[bytes]) -> SideRun:
    from bench.fuzz.redis_inputs import RedisCase, redis_cases

    run = SideRun("redis")
    port = args.port or port_for_later()
    async with (
        redis_server() as url,
        fleet(2, "127.0.0.1", free_port_run(2), ENGINE_FLAGS) as engines,
    ):
        config = _common(port) | {
            "workers": [{"url": e.url, "name": f"w{i}"} for i, e in enumerate(engines)],
            "state": {
                "url": url,
                "namespace": NAMESPACE,
                "load_interval_s": 0.05,
                "stream_retention_s": 5.0,
                "path_timeout_s": 0.05,
            },
        }
        async with router_process(config, port, log, workdir) as router:
            writer = RedisWriter(url, NAMESPACE)
            sample = _sampler(run, router.pid, args.warmup)

            def one(case: RedisCase) -> None:
                writer.apply(case)
                sample()

            strategy = redis_cases(NAMESPACE, ("w0", "w1"))
            try:
                async with watching(port, session_turn(API_KEY, MODEL)) as (normal, probe):
                    await asyncio.to_thread(_drive, args.examples, args.seed, strategy, one)
                    await asyncio.sleep(1.0)  # the last cases read
                await asyncio.to_thread(writer.finish)
                run.notes.append(f"redis after the run: {writer.metrics_snapshot()}")
            finally:
                writer.close()
            page = await asyncio.to_thread(metrics_page, port)
            _finish(run, router.pid, normal, probe, page, REDIS_COUNTS)
    run.aimed = writer.tally.kinds
    run.statuses = Counter({f"refused by Redis: {k}": v for k, v in writer.tally.refused.items()})
    return run


def _finish(
    run: SideRun,
    pid: int,
    normal: Any,
    probe: Any,
    page: str,
    counts: Counts,
) -> None:
    rss = rss_kib(pid)
    if rss is not None:
        run.rss_kib.append((run.cases, rss))
    run.notes.append(
        f"normal traffic: {dict(normal.tally.statuses)}, slowest {normal.tally.slowest_s:.2f} s"
    )
    for line in normal.tally.violations:
        run.notes.append(f"  {line}")
    if normal.tally.failed:
        run.violations["normal traffic not served"] += normal.tally.failed
    run.notes.append(
        f"worst /health stall: {probe.worst_s:.3f} s over {probe.probes} probes "
        f"({probe.failures} failed; limit {STALL_LIMIT_S} s)"
    )
    for at, took in probe.slow:
        shown = time.strftime("%H:%M:%S", time.localtime(at))
        run.notes.append(f"  /health took {took:.3f} s at {shown}")
    if probe.failures or probe.worst_s > STALL_LIMIT_S:
        run.violations["event loop stalled"] += 1
    for name, labels in counts:
        shown = ",".join(f'{k}="{v}"' for k, v in labels.items())
        run.notes.append(f"  {name}{{{shown}}} = {metric_total(page, name, **labels):.0f}")
    if metric_total(page, "kvrouter_redis_loop_failures_total"):
        run.violations["a sync loop failed"] += 1


def rss_growth(samples: list[int]) -> float:
    """How much the router's RSS grew with the cases: the peak of the later half of the
    samples against the peak of the earlier half. A leak raises the later peaks; an
    allocator that moves between two levels (as after the Redis side's bursts) does not,
    where the last sample against the first would read whichever levels they fell on."""
    half = len(samples) // 2
    earlier, later = max(samples[:half]), max(samples[half:])
    return (later - earlier) / earlier


def report(run: SideRun, elapsed: float, log_path: Path) -> bool:
    print(f"side: {run.side}; cases: {run.cases} in {elapsed:.0f} s ({run.cases / elapsed:.0f}/s)")
    print(f"aimed at: {dict(sorted(run.aimed.items()))}")
    print(f"answers: {dict(sorted(run.statuses.items()))}")
    for note in run.notes:
        print(note)
    tracebacks = log_path.read_text(errors="replace").count(TRACEBACK)
    print(f"tracebacks in the router's log: {tracebacks}")
    print(f"property violations: {sum(run.violations.values())} {dict(run.violations)}")
    for example in run.examples:
        print(f"  {example}")
    growth = None
    if len(run.rss_kib) >= 2:
        (n0, first), (n1, last) = run.rss_kib[0], run.rss_kib[-1]
        growth = rss_growth([kib for _, kib in run.rss_kib])
        trail = ", ".join(f"{n}: {kib / 1024:.0f}" for n, kib in run.rss_kib)
        print(f"RSS MiB by cases: {trail}")
        print(
            f"RSS after warm-up ({n0}) {first / 1024:.0f} MiB, at the end ({n1}) "
            f"{last / 1024:.0f} MiB; the later half's peak against the earlier half's: "
            f"{growth:+.1%} (limit {RSS_GROWTH_LIMIT:.0%})"
        )
    return (
        not run.violations and not tracebacks and growth is not None and growth < RSS_GROWTH_LIMIT
    )


def run_side(args: argparse.Namespace, workdir: Path, log_path: Path) -> bool:
    side = engine_side if args.side == "engine" else redis_side

    async def go() -> SideRun:
        with log_path.open("wb") as log:
            return await side(args, workdir, log)

    started = time.monotonic()
    run = asyncio.run(go())
    return report(run, time.monotonic() - started, log_path)
