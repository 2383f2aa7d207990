"""Router performance benchmarks: ``kvrouter bench hashing`` and ``kvrouter bench overhead``.

Both report ratios against a baseline measured in the same run, because this kind of
machine is small and noisy: absolute numbers move from run to run, ratios much less.

* ``hashing``: the routing work for one long prompt (parse the body, canonicalize, hash
  the prefix blocks, look up the longest match on every worker) against parsing the
  same body with orjson alone, which any proxy that reads the model name must do.
* ``overhead``: TTFT and end-to-end latency through the router against the same
  requests sent straight to the engine, at a fixed request rate.
* ``parse-stall``: how long parsing holds the event loop for the largest accepted body in
  the shapes that cost the most per byte, refused or not, against orjson alone.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from bench.loopback import serve_on_loopback
from bench.sim.config import EngineConfig
from bench.sim.server import create_app as create_engine_app
from bench.textgen import text_for
from router.apis.request import parse_request
from router.config import DEFAULT_MAX_BODY_BYTES, RouterConfig, WorkerConfig
from router.errors import BadRequest
from router.index.residency import LocalPrefixIndex
from router.planning.capacity import gpu, load_model
from router.wire.kinds import Kind


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _time(fn: Callable[[], object], repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def hashing(tokens: int, workers: int, repeat: int) -> dict[str, float]:
    body = orjson.dumps(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": text_for("sys", 4000)},
                {"role": "user", "content": text_for("user", tokens - 4000)},
            ],
        }
    )
    block_bytes = 256
    index = LocalPrefixIndex()
    request = parse_request("chat", body, block_bytes)
    for w in range(workers):
        index.add_worker(f"w{w}", 1_000_000)
        # Each worker holds a different share of the prompt, so searches differ.
        index.touch(f"w{w}", request.key.hashes[: len(request.key.hashes) * (w + 1) // workers])

    def route() -> None:
        parsed = parse_request("chat", body, block_bytes)
        for w in range(workers):
            index.match(f"w{w}", parsed.key.hashes)

    baseline = _time(lambda: orjson.loads(body), repeat)
    routed = _time(route, repeat)
    return {
        "prompt_tokens": tokens,
        "body_bytes": len(body),
        "blocks": len(request.key.hashes),
        "workers": workers,
        "orjson_parse_ms_p50": statistics.median(baseline) * 1e3,
        "route_ms_p50": statistics.median(routed) * 1e3,
        "route_ms_p99": _percentile(routed, 0.99) * 1e3,
        "ratio_to_parse": statistics.median(routed) / statistics.median(baseline),
    }


def decision(tokens: int, workers: int, repeat: int) -> dict[str, float]:
    """``Router.dispatch`` + ``Dispatch.finish`` for one long prompt, with the in-process
    index and with the shared one (whose writes also queue events for Redis)."""
    from router.fleet.workers import Fleet, Worker
    from router.observability.metrics import RouterMetrics
    from router.replication.index import SharedPrefixIndex
    from router.routing.dispatch import EngineUsage, Router
    from router.routing.policy_slot import PolicySlot

    body = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": text_for("decision", tokens)}]}
    )
    request = parse_request("chat", body, 256)

    def run(shared: bool) -> list[float]:
        fleet, local = Fleet(), LocalPrefixIndex()
        index = SharedPrefixIndex(local) if shared else local
        for w in range(workers):
            fleet.add(Worker(f"w{w}", f"http://w{w}", 1_000_000))
            index.add_worker(f"w{w}", 1_000_000 // 64)
        metrics = RouterMetrics(fleet, index, 64)
        router = Router(fleet, index, PolicySlot("ttft", {}, 0, metrics), 64, metrics)
        route = router.route_request(request, "r")

        def once() -> None:
            dispatch = router.dispatch(request, route, [])
            dispatch.first_byte()
            dispatch.finish("success", (), EngineUsage(route.prompt_tokens, 0))
            if isinstance(index, SharedPrefixIndex):
                index.outbox.clear()  # what the publisher does, off the request path

        return _time(once, repeat)

    local_times, shared_times = run(False), run(True)
    return {
        "prompt_tokens": tokens,
        "workers": workers,
        "local_us_p50": statistics.median(local_times) * 1e6,
        "local_us_p99": _percentile(local_times, 0.99) * 1e6,
        "shared_us_p50": statistics.median(shared_times) * 1e6,
        "shared_us_p99": _percentile(shared_times, 0.99) * 1e6,
        "shared_over_local_p50": statistics.median(shared_times) / statistics.median(local_times),
        "redis_round_trips_per_decision": 0,
    }


def _filled(head: bytes, item: bytes, tail: bytes, size: int) -> bytes:
    """``head item,item,...,item tail``: as many items as fit in ``size`` bytes."""
    count = (size - len(head) - len(tail) + 1) // (len(item) + 1)
    return head + b",".join([item] * count) + tail


def _stall_bodies(size: int) -> dict[str, tuple[Kind, bytes]]:
    chat = b'{"model": "m", "messages": ['
    text = chat + b'{"role": "user", "content": "'
    parts = chat + b'{"role": "user", "content": ['
    return {
        "long_text": ("chat", text + b"x" * (size - len(text) - 4) + b'"}]}'),
        "empty_messages": ("chat", _filled(chat, b'{"role":"user","content":""}', b"]}", size)),
        "empty_parts": ("chat", _filled(parts, b"{}", b"]}]}", size)),
        # One part holding millions of containers: orjson both reads and rewrites it.
        "nested_objects": (
            "chat",
            _filled(parts + b'{"type": "x", "x": [', b"{}", b"]}]}]}", size),
        ),
        "token_ids": ("completion", _filled(b'{"model": "m", "prompt": [', b"1", b"]}", size)),
    }


def _parse_refused(kind: Kind, body: bytes) -> bool:
    try:
        parse_request(kind, body, 256)
    except BadRequest:
        return True
    return False


def parse_stall(size: int, repeat: int) -> dict[str, float]:
    """``parse_request`` is synchronous: its run time is how long it holds the loop."""
    out: dict[str, float] = {"body_bytes": size}
    for name, (kind, body) in _stall_bodies(size).items():
        parse = functools.partial(_parse_refused, kind, body)
        load = functools.partial(orjson.loads, body)
        out[f"{name}_parse_ms"] = statistics.median(_time(parse, repeat)) * 1e3
        out[f"{name}_orjson_ms"] = statistics.median(_time(load, repeat)) * 1e3
        out[f"{name}_refused"] = float(parse())
    return out


async def _load(
    http: aiohttp.ClientSession, url: str, requests: int, rate: float, prompt_tokens: int
) -> tuple[list[float], list[float]]:
    ttfts: list[float] = []
    totals: list[float] = []

    async def one(i: int) -> None:
        body = {
            "model": "m",
            "stream": True,
            "max_tokens": 16,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": text_for(f"r{i}", prompt_tokens)}],
        }
        start = time.perf_counter()
        first = None
        async with http.post(url + "/v1/chat/completions", json=body) as response:
            async for _ in response.content.iter_any():
                first = first or time.perf_counter()
        end = time.perf_counter()
        ttfts.append((first or end) - start)
        totals.append(end - start)

    tasks = []
    for i in range(requests):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(1 / rate)
    await asyncio.gather(*tasks)
    return ttfts, totals


async def overhead(requests: int, rate: float, prompt_tokens: int) -> dict[str, float]:
    from router.server import serving

    engine_config = EngineConfig(
        model=load_model("llama-3.1-8b"), gpu=gpu("h100"), served_model_name="m", kv_tokens=200_000
    )
    async with serve_on_loopback(create_engine_app(engine_config)) as engine_url:
        router_config = RouterConfig(workers=(WorkerConfig(engine_url),), policy="ttft")
        async with (
            serving(router_config) as (_, router_url),
            aiohttp.ClientSession() as http,
        ):
            results: dict[str, tuple[list[float], list[float]]] = {}
            # Interleave direct and routed rounds so drift hits both alike.
            for label, url in (("direct", engine_url), ("router", router_url)) * 2:
                ttft, total = await _load(http, url, requests // 2, rate, prompt_tokens)
                results.setdefault(label, ([], []))
                results[label][0].extend(ttft)
                results[label][1].extend(total)
    out: dict[str, float] = {"requests_each": requests, "rate": rate}
    for label, (ttft, total) in results.items():
        out[f"{label}_ttft_ms_p50"] = statistics.median(ttft) * 1e3
        out[f"{label}_ttft_ms_p99"] = _percentile(ttft, 0.99) * 1e3
        out[f"{label}_e2e_ms_p50"] = statistics.median(total) * 1e3
        out[f"{label}_e2e_ms_p99"] = _percentile(total, 0.99) * 1e3
    for stat in ("ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p50", "e2e_ms_p99"):
        out[f"added_{stat}"] = out[f"router_{stat}"] - out[f"direct_{stat}"]
        out[f"ratio_{stat}"] = out[f"router_{stat}"] / out[f"direct_{stat}"]
    return out


def _print(results: dict[str, float]) -> None:
    for key, value in results.items():
        print(f"{key:28} {value:12.3f}" if isinstance(value, float) else f"{key:28} {value:>12}")


def register(sub: argparse._SubParsersAction[Any]) -> None:
    h = sub.add_parser("hashing", help="routing work for one long prompt vs parsing it")
    h.add_argument("--tokens", type=int, default=100_000)
    h.add_argument("--workers", type=int, default=8)
    h.add_argument("--repeat", type=int, default=200)
    h.set_defaults(func=_run_hashing)
    d = sub.add_parser("decision", help="routing decision cost, in-process vs shared index")
    d.add_argument("--tokens", type=int, default=20_000)
    d.add_argument("--workers", type=int, default=8)
    d.add_argument("--repeat", type=int, default=2000)
    d.set_defaults(func=_run_decision)
    s = sub.add_parser("parse-stall", help="event-loop time parsing the largest bodies")
    s.add_argument("--body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    s.add_argument("--repeat", type=int, default=3)
    s.set_defaults(func=_run_parse_stall)
    o = sub.add_parser("overhead", help="latency through the router vs straight to the engine")
    o.add_argument("--requests", type=int, default=400)
    o.add_argument("--rate", type=float, default=20.0, help="requests per second")
    o.add_argument("--prompt-tokens", type=int, default=1000)
    o.set_defaults(func=_run_overhead)


def _run_hashing(args: argparse.Namespace) -> int:
    _print(hashing(args.tokens, args.workers, args.repeat))
    return 0


def _run_decision(args: argparse.Namespace) -> int:
    _print(decision(args.tokens, args.workers, args.repeat))
    return 0


def _run_parse_stall(args: argparse.Namespace) -> int:
    _print(parse_stall(args.body_bytes, args.repeat))
    return 0


def _run_overhead(args: argparse.Namespace) -> int:
    _print(asyncio.run(overhead(args.requests, args.rate, args.prompt_tokens)))
    return 0
