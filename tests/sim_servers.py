"""Simulated engines behind either HTTP front-end, for the tests of the engine itself.

``bench/sim/server.py`` (aiohttp) serves the in-process engines every other test uses;
``bench/sim/http1.py`` (httptools) serves the engine's own process. The engine's tests
run against both (``FRONTS``), so neither carries an endpoint the other lacks.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from bench.sim.config import EngineConfig
from bench.sim.engine import running_engine
from bench.sim.http1 import serving
from tests.conftest import RunningEngine, engine_config, serve_engine

FRONTS = ("aiohttp", "httptools")


@contextlib.asynccontextmanager
async def serve_engine_on(front: str, config: EngineConfig) -> AsyncIterator[RunningEngine]:
    """A fresh engine of ``config`` behind ``front`` on a free loopback port."""
    if front == "aiohttp":
        async with serve_engine(config) as running:
            yield running
        return
    async with running_engine(config) as engine, serving(engine, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        yield RunningEngine(f"http://127.0.0.1:{port}", engine, config)


def factory_on(
    front: str,
) -> Callable[..., contextlib.AbstractAsyncContextManager[RunningEngine]]:
    """``conftest.engine_factory`` behind ``front``."""

    def make(**overrides: Any) -> contextlib.AbstractAsyncContextManager[RunningEngine]:
        return serve_engine_on(front, engine_config(**overrides))

    return make


async def post(http: aiohttp.ClientSession, url: str, body: Any, status: int = 200) -> Any:
    """``body`` (JSON, or bytes as they are) posted to ``url``: the JSON answer, which
    must come with ``status``."""
    data = body if isinstance(body, bytes) else None
    json_body = None if isinstance(body, bytes) else body
    async with http.post(url, data=data, json=json_body) as response:
        assert response.status == status, (body, await response.text())
        return await response.json()
