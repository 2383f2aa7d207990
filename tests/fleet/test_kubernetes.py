"""Discovery from EndpointSlices, against an aiohttp app speaking the API's list and watch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from bench.loopback import serve_on_loopback
from router.backoff import Backoff
from router.config import DiscoveryConfig, KubernetesConfig
from router.discovery.kubernetes import MAX_EVENT_BYTES, slice_workers
from tests.conftest import EngineFactory, RunningRouter, router_config, serve_router
from tests.router_client import engines, wait_for

SELECTOR = "app=vllm"
TOKEN = "pod-token"


def endpoint_slice(name: str, port: int, pods: dict[str, bool], version: int) -> dict[str, Any]:
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "addressType": "IPv4",
        "metadata": {"name": name, "resourceVersion": str(version), "labels": {"app": "vllm"}},
        "endpoints": [
            {
                "addresses": ["127.0.0.1"],
                "conditions": {"ready": ready},
                "targetRef": {"kind": "Pod", "name": pod},
            }
            for pod, ready in pods.items()
        ],
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    }


class FakeApiServer:
    """EndpointSlice list (GET) and watch (GET ?watch=1, JSON lines) for one namespace."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        # Lines for the watch, each with whether the server ends the watch after it.
        self.events: asyncio.Queue[tuple[bytes, bool]] = asyncio.Queue()
        self.lists = 0
        self.version = 1

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        assert request.query["labelSelector"] == SELECTOR
        if request.query.get("watch") != "1":
            self.lists += 1
            return web.json_response(
                {
                    "kind": "EndpointSliceList",
                    "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": list(self.slices.values()),
                }
            )
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        while True:
            line, last = await self.events.get()
            await response.write(line + b"\n")
            if last:
                await response.write_eof()
                return response

    def push(self, kind: str, item: dict[str, Any]) -> None:
        self.version += 1
        if kind == "DELETED":
            self.slices.pop(item["metadata"]["name"], None)
        elif kind != "ERROR":
            self.slices[item["metadata"]["name"]] = item
        self.events.put_nowait((orjson.dumps({"type": kind, "object": item}), kind == "ERROR"))

    def push_line(self, line: bytes) -> None:
        """Anything at all, as one line of the watch."""
        self.version += 1
        self.events.put_nowait((line, False))


def names(router: RunningRouter) -> set[str]:
    return set(router.state.router.fleet.workers)


def test_slice_workers_skips_unready_endpoints_and_picks_the_named_port() -> None:
    item = endpoint_slice("s", 8000, {"a": True, "b": False}, 1)
    item["ports"].insert(0, {"name": "metrics", "port": 9090})
    assert [w.url for w in slice_workers(item, "http")] == ["http://127.0.0.1:8000"]
    assert [w.name for w in slice_workers(item, "http")] == ["a"]
    assert [w.url for w in slice_workers(item, "")] == ["http://127.0.0.1:9090"]


async def test_workers_follow_the_endpoint_slices(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    api = FakeApiServer()
    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/inference/endpointslices", api.handle)
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    async with engines(engine_factory, 2) as fleet, serve_on_loopback(app) as api_url:
        port0, port1 = (int(e.url.rsplit(":", 1)[1]) for e in fleet)
        api.slices["s0"] = endpoint_slice("s0", port0, {"vllm-0": True}, 1)
        k8s = KubernetesConfig(
            selector=SELECTOR,
            namespace="inference",
            api_url=api_url,
            token_file=str(token),
            port_name="http",
        )
        config = router_config([], discovery=DiscoveryConfig(kubernetes=k8s, interval_s=0.05))
        async with serve_router(config) as router:
            assert names(router) == {"vllm-0"}  # from the first list, before any watch

            async def has(expected: set[str]) -> bool:
                return names(router) == expected

            api.push("ADDED", endpoint_slice("s1", port1, {"vllm-1": True}, 2))
            await wait_for(lambda: has({"vllm-0", "vllm-1"}))
            api.push("MODIFIED", endpoint_slice("s1", port1, {"vllm-1": False}, 3))
            await wait_for(lambda: has({"vllm-0"}))  # not ready: out
            api.push("ERROR", {"kind": "Status", "code": 410, "metadata": {}})
            await wait_for(lambda: _at_least(api.lists, 2))  # 410 Gone: relisted
            api.push("DELETED", endpoint_slice("s0", port0, {"vllm-0": True}, 4))
            await wait_for(lambda: has(set()))


async def _at_least(value: int, minimum: int) -> bool:
    return value >= minimum


def test_slice_workers_skips_what_it_cannot_read() -> None:
    garbage: list[dict[str, Any]] = [
        {"ports": "http", "endpoints": [42]},
        {"ports": [{"port": "8000"}], "endpoints": [{"addresses": ["127.0.0.1"]}]},
        {"ports": [{"port": 8000}], "endpoints": [42, {"addresses": "127.0.0.1"}]},
        {"ports": [{"port": 8000}], "endpoints": [{"addresses": [7, ""], "targetRef": "p"}]},
        {"ports": [{"port": 8000}], "endpoints": [{"addresses": ["::1"], "conditions": []}]},
    ]
    assert [[w.url for w in slice_workers(item, "")] for item in garbage] == [
        [],
        [],
        [],
        [],
        ["http://[::1]:8000"],
    ]


def test_backoff_doubles_to_its_cap_and_starts_over() -> None:
    backoff = Backoff(0.5, 3.0)
    assert [backoff.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.next() == 0.5


@contextlib.asynccontextmanager
async def watched(
    api: FakeApiServer, factory: EngineFactory, tmp_path: Path
) -> AsyncIterator[tuple[RunningRouter, list[int]]]:
    """A router discovering from ``api``, which starts with slice s0 (pod vllm-0), and the
    ports of two engines."""
    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/inference/endpointslices", api.handle)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    async with engines(factory, 2) as fleet, serve_on_loopback(app) as api_url:
        ports = [int(e.url.rsplit(":", 1)[1]) for e in fleet]
        api.slices["s0"] = endpoint_slice("s0", ports[0], {"vllm-0": True}, 1)
        k8s = KubernetesConfig(
            selector=SELECTOR,
            namespace="inference",
            api_url=api_url,
            token_file=str(token),
            port_name="http",
        )
        config = router_config([], discovery=DiscoveryConfig(kubernetes=k8s, interval_s=0.05))
        async with serve_router(config) as router:
            assert names(router) == {"vllm-0"}
            yield router, ports


async def _named(router: RunningRouter, expected: set[str]) -> bool:
    return names(router) == expected


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "router.discovery.kubernetes" and r.levelno == logging.WARNING
    ]


async def test_long_watch_lines(
    engine_factory: EngineFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api = FakeApiServer()
    async with watched(api, engine_factory, tmp_path) as (router, ports):
        big = endpoint_slice("s1", ports[1], {"vllm-1": True}, 2)
        big["endpoints"] += [
            {
                "addresses": ["127.0.0.2"],
                "conditions": {"ready": False},
                "targetRef": {"kind": "Pod", "name": f"padding-{i:05d}"},
            }
            for i in range(10_000)
        ]
        # ~1 MiB: within etcd's limit on one object, past what aiohttp reads as one line
        assert len(orjson.dumps(big)) > 2**20
        api.push("ADDED", big)
        await wait_for(lambda: _named(router, {"vllm-0", "vllm-1"}))
        api.push_line(b"x" * (MAX_EVENT_BYTES + 1))  # past ours: the watch starts over
        await wait_for(lambda: _at_least(api.lists, 2))
        api.push("DELETED", endpoint_slice("s0", ports[0], {"vllm-0": True}, 4))
        await wait_for(lambda: _named(router, {"vllm-1"}))
        assert any("bytes" in message for message in _warnings(caplog))


async def test_a_malformed_watch_event_restarts_the_watch(
    engine_factory: EngineFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api = FakeApiServer()
    async with watched(api, engine_factory, tmp_path) as (router, ports):
        api.push("ADDED", {"metadata": {"name": "odd"}, "ports": "http", "endpoints": [42]})
        api.push_line(b'{"type": "ADDED", "object": ["not", "a", "slice"]}')
        await wait_for(lambda: _at_least(api.lists, 2))  # relisted
        api.push("ADDED", endpoint_slice("s1", ports[1], {"vllm-1": True}, 3))
        await wait_for(lambda: _named(router, {"vllm-0", "vllm-1"}))
        assert any("object" in message for message in _warnings(caplog))
