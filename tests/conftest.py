"""Shared fixtures: simulated engines served over real loopback HTTP."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
from aiohttp import web

from bench.loopback import serve_on_loopback
from bench.sim.config import EngineConfig
from bench.sim.engine import Engine
from bench.sim.server import ENGINE_KEY, create_app
from router.app import create_app as create_router_app
from router.capacity import gpu, load_model
from router.config import HealthConfig, RouterConfig, WorkerConfig

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
    async with serve_on_loopback(app) as url:
        yield RunningEngine(url, app[ENGINE_KEY], config)


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


# -- the router ----------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class RunningRouter:
    url: str
    app: web.Application
    config: RouterConfig


def router_config(engines: Sequence[RunningEngine], **overrides: Any) -> RouterConfig:
    """A router over ``engines``, named w0, w1, ... in order; ``overrides`` are
    ``RouterConfig`` fields. Health probes are slow unless a test asks otherwise, so
    the only probe is the one at startup."""
    workers = tuple(WorkerConfig(e.url, name=f"w{i}") for i, e in enumerate(engines))
    values: dict[str, Any] = {"workers": workers, "host": "127.0.0.1", "port": 0,
                              "health": HealthConfig(interval_s=60.0), "seed": 1}
    values.update(overrides)
    return RouterConfig(**values)


@contextlib.asynccontextmanager
async def serve_router(config: RouterConfig) -> AsyncIterator[RunningRouter]:
    """A router app on a free loopback port, stopped on exit."""
    app = create_router_app(config)
    async with serve_on_loopback(app) as url:
        yield RunningRouter(url, app, config)
