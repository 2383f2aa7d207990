"""Shared fixtures: simulated engines served over real loopback HTTP."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from bench.sim.config import EngineConfig
from bench.sim.engine import Engine
from bench.sim.server import ENGINE_KEY, create_app
from router.capacity import gpu, load_model

TEST_MODEL = "sim-model"
# Fast enough for CI, slow enough that the roofline still orders events.
TEST_TIME_SCALE = 20.0


def engine_config(**overrides: Any) -> EngineConfig:
    base = EngineConfig(
        model=load_model("llama-3.1-8b"),
        gpu=gpu("h100"),
        served_model_name=TEST_MODEL,
        time_scale=TEST_TIME_SCALE,
        kv_tokens=50_000,
    )
    return dataclasses.replace(base, **overrides)


@dataclasses.dataclass(slots=True)
class RunningEngine:
    url: str
    engine: Engine
    config: EngineConfig


@contextlib.asynccontextmanager
async def serve_engine(config: EngineConfig) -> AsyncIterator[RunningEngine]:
    """One simulated engine on a free loopback port, stopped on exit."""
    app = create_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield RunningEngine(f"http://127.0.0.1:{port}", app[ENGINE_KEY], config)
    finally:
        await runner.cleanup()


EngineFactory = Callable[..., contextlib.AbstractAsyncContextManager[RunningEngine]]


@pytest.fixture
def engine_factory() -> EngineFactory:
    """``async with engine_factory(kv_tokens=...) as sim:`` starts an engine."""

    def make(**overrides: Any) -> contextlib.AbstractAsyncContextManager[RunningEngine]:
        return serve_engine(engine_config(**overrides))

    return make


@pytest.fixture
async def sim() -> AsyncIterator[RunningEngine]:
    async with serve_engine(engine_config()) as running:
        yield running
