"""Shared fixtures: simulated engines served over real loopback HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from bench.loopback import serve_on_loopback
from bench.ports import port_for_later
from bench.sim.config import EngineConfig
from bench.sim.engine import Engine
from bench.sim.server import ENGINE_KEY, create_app
from router.config import HealthConfig, RouterConfig, WorkerConfig
from router.planning.capacity import gpu, load_model
from router.server import serving
from router.state import RouterState
from tests.token_model import build_model_dir
from tests.vllm_engines import VllmEngine, install_vllm, start_engines, write_model

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
    state: RouterState
    config: RouterConfig


def router_config(engines: Sequence[RunningEngine], **overrides: Any) -> RouterConfig:
    """A router over ``engines``, named w0, w1, ... in order; ``overrides`` are
    ``RouterConfig`` fields. Health probes are slow unless a test asks otherwise, so
    the only probe is the one at startup. Responses name their worker
    (X-Kvrouter-Worker), which the tests read."""
    workers = tuple(WorkerConfig(e.url, name=f"w{i}") for i, e in enumerate(engines))
    values: dict[str, Any] = {
        "workers": workers,
        "host": "127.0.0.1",
        "port": 0,
        "health": HealthConfig(interval_s=60.0),
        "seed": 1,
        "worker_header": True,
    }
    values.update(overrides)
    return RouterConfig(**values)


@contextlib.asynccontextmanager
async def serve_router(config: RouterConfig) -> AsyncIterator[RunningRouter]:
    """A router app on a free loopback port, stopped on exit."""
    async with serving(config) as (server, url):
        yield RunningRouter(url, server.state, config)


# -- redis ---------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class RedisServer:
    """A real redis-server on a free loopback port, restartable on the same port."""

    port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn,
            ):
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        self.process = None

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as conn:
            conn.sendall(b"FLUSHALL\r\n")
            conn.recv(16)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the test session (never the machine's shared one)."""
    server = RedisServer(port_for_later())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's redis, emptied for this test."""
    if redis_server.process is None:
        redis_server.start()
    redis_server.flush()
    return redis_server.url


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory with Qwen3's real tokenizer (``tests/token_model.py``), for
    prefix.tokenizer and the simulated engine's --tokenizer."""
    return build_model_dir(tmp_path_factory.mktemp("qwen3"))


# -- real vLLM engines ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def vllm_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmEngine]]:
    """Two real vLLM engines (CPU build, tiny Qwen3, real tokenizer) for the whole test
    session: installed on first use, started together, stopped at the end."""
    venv = install_vllm()
    model = write_model(tmp_path_factory.mktemp("tiny-qwen3"))
    logs = tmp_path_factory.mktemp("vllm-logs")
    engines = [VllmEngine(venv, model, logs, f"v{i}") for i in range(2)]
    asyncio.run(start_engines(engines))
    try:
        yield engines
    finally:
        for engine in engines:
            engine.stop()
