"""A fleet of simulated engines, one process and one port each."""

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
from typing import IO

import aiohttp

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 30.0


@dataclass(slots=True)
class EngineProcess:
    engine_id: str
    url: str
    port: int
    process: asyncio.subprocess.Process

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
) -> EngineProcess:
    """Start one engine process; ``source`` runs the engine of another checkout (its
    ``router.cli``), as the benchmarks that compare engine versions do; ``log`` takes its
    stderr (default: this process's)."""
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
    return EngineProcess(engine_id, f"http://{host}:{port}", port, process)


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
) -> AsyncIterator[list[EngineProcess]]:
    """Start ``n`` engine processes on consecutive ports, engine ``i`` with ``flags``
    then ``per_engine_flags[i]`` (later flags win); stop them on exit."""
    engines: list[EngineProcess] = []
    try:
        for i in range(n):
            extra = per_engine_flags[i] if i < len(per_engine_flags) else ()
            engines.append(await start_engine(str(i), host, base_port + i, [*flags, *extra]))
        await wait_healthy([e.url for e in engines])
        yield engines
    finally:
        await stop(engines)


async def run_fleet_forever(n: int, host: str, base_port: int, flags: Sequence[str]) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    async with fleet(n, host, base_port, flags) as engines:
        for engine in engines:
            print(f"engine {engine.engine_id}: {engine.url}", flush=True)
        print("fleet ready; Ctrl-C stops it", flush=True)
        waiters = [asyncio.create_task(e.process.wait()) for e in engines]
        stop_task = asyncio.create_task(stopping.wait())
        done, _ = await asyncio.wait([stop_task, *waiters], return_when=asyncio.FIRST_COMPLETED)
        for task in [stop_task, *waiters]:
            task.cancel()
        if stop_task not in done:
            log.error("an engine exited on its own; stopping the fleet")
