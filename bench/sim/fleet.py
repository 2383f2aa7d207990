"""A fleet of simulated engines, one process and one port each; with KV events, two
more ports each (``KVEventPorts``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
import orjson

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class KVEventPorts:
    """Engine ``i`` publishes its KV events on ``base + 2i`` and answers replays on
    ``base + 2i + 1``, with the other fields of ``config`` (vLLM's
    ``--kv-events-config`` JSON) if given."""

    base: int
    config: str | None = None

    def ports(self, index: int) -> tuple[int, int]:
        return self.base + 2 * index, self.base + 2 * index + 1

    def flags(self, index: int) -> list[str]:
        """The ``--kv-events-config`` of engine ``index``: bound on every interface, as
        vLLM binds ``tcp://*:PORT``."""
        publish, replay = self.ports(index)
        fields: dict[str, Any] = orjson.loads(self.config) if self.config else {}
        fields.update(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{publish}",
            replay_endpoint=f"tcp://*:{replay}",
        )
        return ["--kv-events-config", orjson.dumps(fields).decode()]


@dataclass(slots=True)
class EngineProcess:
    engine_id: str
    url: str
    port: int
    process: asyncio.subprocess.Process
    # Where subscribers connect for its KV events and their replay (None: not published).
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None

    def describe(self) -> dict[str, str]:
        """The engine as ``kvrouter sim fleet`` prints it: its id, URL and endpoints."""
        described = {"engine_id": self.engine_id, "url": self.url}
        if self.kv_events_endpoint is not None:
            described["kv_events_endpoint"] = self.kv_events_endpoint
        if self.kv_events_replay_endpoint is not None:
            described["kv_events_replay_endpoint"] = self.kv_events_replay_endpoint
        return described

    def kill(self) -> None:
        """SIGKILL, as a crashed worker; ``wait()`` reaps it."""
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()


async def start_engine(
    engine_id: str,
    host: str,
    port: int,
    flags: Sequence[str],
    source: Path | None = None,
    log: IO[bytes] | None = None,
    kv_events: tuple[int, int] | None = None,
) -> EngineProcess:
    """Start one engine process; ``source`` runs the engine of another checkout (its
    ``router.cli``), as the benchmarks that compare engine versions do; ``log`` takes its
    stderr (default: this process's); ``kv_events``: the ports its KV events go out and
    are replayed on, when ``flags`` has it publish them."""
    env = None if source is None else _running_from(source)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.cli",
        "--log-level",
        "WARNING",
        "sim",
        "engine",
        "--port",
        str(port),
        "--engine-id",
        engine_id,
        *flags,
        "--host",
        host,
        env=env,
        cwd=source,
        stderr=log,
    )
    engine = EngineProcess(engine_id, f"http://{host}:{port}", port, process)
    if kv_events is not None:
        engine.kv_events_endpoint = f"tcp://{host}:{kv_events[0]}"
        engine.kv_events_replay_endpoint = f"tcp://{host}:{kv_events[1]}"
    return engine


def _running_from(source: Path) -> dict[str, str]:
    """The environment in which ``python -m router.cli`` imports ``source``'s packages."""
    return {**os.environ, "PYTHONPATH": str(source.resolve())}


async def wait_healthy(urls: Sequence[str], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        for url in urls:
            while True:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.get(f"{url}/health") as response:
                        if response.status == 200:
                            break
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"engine at {url} not healthy after {timeout_s:g}s")
                await asyncio.sleep(0.05)


async def stop(engines: Sequence[EngineProcess]) -> None:
    for engine in engines:
        if engine.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                engine.process.terminate()
    for engine in engines:
        try:
            await asyncio.wait_for(engine.process.wait(), 5)
        except TimeoutError:
            engine.kill()
            await engine.process.wait()


@contextlib.asynccontextmanager
async def fleet(
    n: int,
    host: str,
    base_port: int,
    flags: Sequence[str],
    per_engine_flags: Sequence[Sequence[str]] = (),
    kv_events: KVEventPorts | None = None,
) -> AsyncIterator[list[EngineProcess]]:
    """Start ``n`` engine processes on consecutive ports, engine ``i`` with ``flags``
    then ``per_engine_flags[i]`` (later flags win) and, with ``kv_events``, publishing
    on its own ports; stop them on exit."""
    engines: list[EngineProcess] = []
    try:
        for i in range(n):
            extra = list(per_engine_flags[i]) if i < len(per_engine_flags) else []
            ports = None
            if kv_events is not None:
                ports = kv_events.ports(i)
                extra += kv_events.flags(i)
            engines.append(
                await start_engine(str(i), host, base_port + i, [*flags, *extra], kv_events=ports)
            )
        await wait_healthy([e.url for e in engines])
        yield engines
    finally:
        await stop(engines)


def describe_line(engine: EngineProcess) -> str:
    """``engine 0: http://host:port``, then its KV event endpoints if it publishes."""
    endpoints = {k: v for k, v in engine.describe().items() if k.startswith("kv_events")}
    return " ".join(
        [f"engine {engine.engine_id}: {engine.url}", *(f"{k}={v}" for k, v in endpoints.items())]
    )


async def run_fleet_forever(
    n: int, host: str, base_port: int, flags: Sequence[str], kv_events: KVEventPorts | None = None
) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    async with fleet(n, host, base_port, flags, kv_events=kv_events) as engines:
        for engine in engines:
            print(describe_line(engine), flush=True)
        print("fleet ready; Ctrl-C stops it", flush=True)
        waiters = [asyncio.create_task(e.process.wait()) for e in engines]
        stop_task = asyncio.create_task(stopping.wait())
        done, _ = await asyncio.wait([stop_task, *waiters], return_when=asyncio.FIRST_COMPLETED)
        for task in [stop_task, *waiters]:
            task.cancel()
        if stop_task not in done:
            log.error("an engine exited on its own; stopping the fleet")
