"""Worker discovery from Kubernetes EndpointSlices: list, then watch, by label selector.

Runs in the pod with its service account (token and CA from the standard mount). The
current slices are kept by name; every ready endpoint address, on the slice's port (the
one named ``port_name``, or the first), is a worker named after its pod. The watch
resumes from the last resourceVersion; a 410 Gone or a broken stream relists after a
backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from router.config import KubernetesConfig, WorkerConfig
from router.errors import ConfigError

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
BACKOFF_MAX_S = 30.0
WATCH_TIMEOUT_S = 300  # the API server ends a watch after this; we then resume it


def _api_url(config: KubernetesConfig) -> str:
    if config.api_url:
        return config.api_url.rstrip("/")
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get(
        "KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ConfigError("discovery.kubernetes.api_url: not set and not running in a pod")
    return f"https://{host}:{port}"


def slice_workers(item: dict[str, Any], port_name: str) -> list[WorkerConfig]:
    """The ready endpoints of one EndpointSlice, as workers."""
    ports = item.get("ports") or []
    port = next((p.get("port") for p in ports if not port_name or p.get("name") == port_name),
                None)
    if not isinstance(port, int):
        return []
    workers = []
    for endpoint in item.get("endpoints") or []:
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        pod = (endpoint.get("targetRef") or {}).get("name")
        for address in endpoint.get("addresses") or []:
            host = f"[{address}]" if ":" in address else address
            name = pod if pod and len(endpoint.get("addresses") or []) == 1 else None
            workers.append(WorkerConfig(f"http://{host}:{port}",
                                        name=name or f"{host}:{port}"))
    return workers


class EndpointSliceSource:
    def __init__(self, config: KubernetesConfig, session: aiohttp.ClientSession) -> None:
        self._config = config
        self._session = session
        self._slices: dict[str, dict[str, Any]] = {}
        self._listed = False
        self._version: str | None = None
        self._task: asyncio.Task[None] | None = None
        namespace = config.namespace
        if not namespace:
            ns_file = SERVICE_ACCOUNT / "namespace"
            namespace = ns_file.read_text().strip() if ns_file.exists() else "default"
        self._path = (f"{_api_url(config)}/apis/discovery.k8s.io/v1/namespaces/{namespace}"
                      "/endpointslices")

    def _headers(self) -> dict[str, str]:
        token_file = Path(self._config.token_file)
        if token_file.exists():  # re-read each time: projected tokens rotate
            return {"Authorization": f"Bearer {token_file.read_text().strip()}"}
        return {}

    def _ssl(self) -> ssl.SSLContext | bool:
        if self._path.startswith("http://"):
            return False
        ca = Path(self._config.ca_file)
        return ssl.create_default_context(cafile=str(ca)) if ca.exists() else True

    async def workers(self) -> list[WorkerConfig] | None:
        if self._task is None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                await self._list()  # the first answer comes from a list, not a watch
            self._task = asyncio.create_task(self._run(), name="kvrouter-k8s-watch")
        if not self._listed:
            return None  # not known yet: keep what is
        return [w for item in self._slices.values()
                for w in slice_workers(item, self._config.port_name)]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        backoff = 0.5
        while True:
            try:
                if self._version is None:
                    await self._list()
                backoff = 0.5
                await self._watch()
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
                log.warning("kubernetes discovery: %r; retrying in %.1f s", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(BACKOFF_MAX_S, backoff * 2)

    async def _list(self) -> None:
        params = {"labelSelector": self._config.selector}
        async with self._session.get(self._path, params=params, headers=self._headers(),
                                     ssl=self._ssl()) as response:
            response.raise_for_status()
            body = orjson.loads(await response.read())
        self._slices = {item["metadata"]["name"]: item for item in body.get("items") or []}
        self._listed = True
        self._version = str(body["metadata"]["resourceVersion"])

    async def _watch(self) -> None:
        """Follow changes from ``self._version``; returns when the watch ends (resume) or
        the server says the version is gone (``_version`` cleared: relist)."""
        params = {"labelSelector": self._config.selector, "watch": "1",
                  "resourceVersion": self._version or "", "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(WATCH_TIMEOUT_S)}
        timeout = aiohttp.ClientTimeout(total=None, sock_read=WATCH_TIMEOUT_S + 30)
        async with self._session.get(self._path, params=params, headers=self._headers(),
                                     ssl=self._ssl(), timeout=timeout) as response:
            response.raise_for_status()
            async for line in response.content:
                if line.strip() and not self._apply(orjson.loads(line)):
                    self._version = None  # 410 Gone or another error: relist
                    return

    def _apply(self, event: dict[str, Any]) -> bool:
        kind, item = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            log.info("kubernetes discovery: watch error %s; relisting", item.get("code"))
            return False
        self._version = str(item["metadata"].get("resourceVersion") or self._version)
        if kind == "BOOKMARK":
            return True
        name = item["metadata"]["name"]
        if kind == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = item
        return True
