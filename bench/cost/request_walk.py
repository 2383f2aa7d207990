"""``kvrouter bench walk``: the path one request takes through the router's code.

A router in this process, two simulated engines in processes of their own (so that
nothing but the router runs router code here); one warm-up request, then one traced with
``sys.setprofile``: every Python call into a module of ``router/`` or ``policies/`` names
its file. Consecutive calls in one file are one visit. Printed: the files visited,
the visits, and the returns (visits to a file the request had already left), with the
sequence itself under ``--show``. Fewer returns: a request that walks the router top to
bottom rather than back and forth. Health probes and scrapes are spaced far apart so that
only the request is traced.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import orjson

from bench.ports import free_port_run
from bench.sim.fleet import fleet

ROOT = Path(__file__).resolve().parents[2]
TRACED = (str(ROOT / "router") + "/", str(ROOT / "policies") + "/")
MODEL = "walk-model"
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}


@dataclass(slots=True)
class Walk:
    visits: list[str] = field(default_factory=list)  # a file per visit, in order

    def enter(self, path: str) -> None:
        if not self.visits or self.visits[-1] != path:
            self.visits.append(path)

    @property
    def files(self) -> int:
        return len(set(self.visits))

    @property
    def returns(self) -> int:
        """Visits to a file the walk had already left."""
        return len(self.visits) - self.files


def _body(api: str, stream: bool) -> dict[str, Any]:
    text = "walk the router " * 200
    if api == "completions":
        return {"model": MODEL, "prompt": text, "max_tokens": 8, "stream": stream}
    if api == "responses":
        return {"model": MODEL, "input": text, "stream": stream, "store": False}
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": stream}
    return body | {"max_tokens": 8}


def tracer(walk: Walk) -> Callable[[FrameType, str, Any], None]:
    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(TRACED):
                walk.enter(str(Path(path).relative_to(ROOT)))

    return profile


async def walk_one(api: str, stream: bool, compressed: bool) -> Walk:
    from router.config import HealthConfig, RouterConfig, WorkerConfig
    from router.server import serving

    base = free_port_run(3)
    flags = ["--served-model-name", MODEL, "--time-scale", "1000"]
    async with fleet(2, "127.0.0.1", base, flags) as engines:
        config = RouterConfig(
            workers=tuple(WorkerConfig(e.url, name=f"w{i}") for i, e in enumerate(engines)),
            health=HealthConfig(interval_s=3600, scrape_interval_s=3600, stale_after_s=7200),
        )
        async with (
            serving(config, port=base + 2) as (_, url),
            aiohttp.ClientSession() as http,
        ):
            raw = orjson.dumps(_body(api, stream))
            headers = {"Content-Type": "application/json"}
            if compressed:
                raw, headers["Content-Encoding"] = gzip.compress(raw), "gzip"

            async def send() -> None:
                async with http.post(url + PATHS[api], data=raw, headers=headers) as response:
                    await response.read()
                    assert response.status == 200, response.status

            await send()  # warm-up: connections, caches, lazy imports
            walk = Walk()
            sys.setprofile(tracer(walk))
            try:
                await send()
            finally:
                sys.setprofile(None)
    return walk


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "walk",
        help="the files one request visits in the router",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--api", choices=sorted(PATHS), default="chat", help="the API spoken")
    parser.add_argument("--stream", action="store_true", help="a streamed request")
    parser.add_argument("--gzip", action="store_true", help="a gzipped request body")
    parser.add_argument("--show", action="store_true", help="print every visit in order")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    walk = asyncio.run(walk_one(args.api, args.stream, args.gzip))
    if args.show:
        for path in walk.visits:
            print(path)
    kind = f"{args.api}{' streamed' if args.stream else ''}{' gzipped' if args.gzip else ''}"
    print(
        f"one {kind} request: {walk.files} files, {len(walk.visits)} visits, "
        f"{walk.returns} returns to a file already left"
    )
    return 0
