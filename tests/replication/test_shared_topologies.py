"""Shared state through Redis Sentinel and Redis Cluster (real servers on free ports)."""

from __future__ import annotations

import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from bench.ports import free_port
from router.config import StateConfig
from tests.conftest import EngineFactory, router_config, serve_router
from tests.replication.test_shared_state import run_session
from tests.router_client import engines


def _redis(port: int, *extra: str, folder: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(folder),
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _wait(port: int, *command: str, expect: bytes = b"PONG") -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        result = subprocess.run(
            ["redis-cli", "-p", str(port), *(command or ("PING",))],
            capture_output=True,
            timeout=5,
            check=False,
        )
        if expect in result.stdout:
            return
        time.sleep(0.1)
    raise RuntimeError(f"redis on {port} not ready for {command}")


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is a valid port too."""
    while True:
        port = free_port()
        if port + 10000 <= 65535:
            return port


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.kill()
        process.wait(5)


@pytest.fixture(scope="module")
def sentinel_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("sentinel")
    master, sentinel = free_port(), free_port()
    conf = folder / "sentinel.conf"
    conf.write_text(
        f"port {sentinel}\nbind 127.0.0.1\nsentinel monitor kvmaster 127.0.0.1 {master} 1\n"
    )
    processes = [_redis(master, folder=folder)]
    try:
        _wait(master)
        processes.append(
            subprocess.Popen(
                ["redis-server", str(conf), "--sentinel"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        _wait(
            sentinel, "SENTINEL", "get-master-addr-by-name", "kvmaster", expect=str(master).encode()
        )
        yield f"redis+sentinel://127.0.0.1:{sentinel}/kvmaster/0"
    finally:
        _stop(processes)


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("cluster")
    ports = [_cluster_port() for _ in range(3)]
    processes = [
        _redis(
            p,
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(folder / f"nodes-{p}.conf"),
            folder=folder,
        )
        for p in ports
    ]
    try:
        for port in ports:
            _wait(port)
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            timeout=30,
            check=True,
        )
        _wait(ports[0], "CLUSTER", "INFO", expect=b"cluster_state:ok")
        yield f"redis+cluster://127.0.0.1:{ports[0]}"
    finally:
        _stop(processes)


@pytest.mark.parametrize("topology", ["sentinel_url", "cluster_url"])
async def test_replicas_share_state_through(
    topology: str, request: pytest.FixtureRequest, engine_factory: EngineFactory
) -> None:
    url = request.getfixturevalue(topology)
    state = StateConfig(url=url, flush_interval_s=0.005, load_interval_s=0.1)
    async with (
        engines(engine_factory, 3) as fleet,
        serve_router(router_config(fleet, state=state)) as a,
        serve_router(router_config(fleet, state=state, seed=2)) as b,
        aiohttp.ClientSession() as http,
    ):
        seen = await run_session(http, [a, b], f"topo-{topology}", 5, random.Random(1))
    assert len({worker for worker, _ in seen}) == 1, seen
    assert all(cached > 0 for _, cached in seen[1:])
