"""Worker discovery from Kubernetes EndpointSlices: list, then watch, by label selector.

Runs in the pod with its service account (token and CA from the standard mount). The
current slices are kept by name; every ready endpoint address, on the slice's port (the
one named ``port_name``, or the first), is a worker named after its pod. The watch
resumes from the last resourceVersion when the server ends it; a 410 Gone relists at
once. Anything else that stops the watch (a broken stream, a line over
``MAX_EVENT_BYTES``, an event that is not an object with metadata, a bug) is logged with
its reason and the watch starts over from a fresh list after a backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from router.backoff import Backoff
from router.config import KubernetesConfig, WorkerConfig
from router.errors import ConfigError

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
# Over etcd's 1.5 MiB limit on one object: only a broken stream sends a longer line.
MAX_EVENT_BYTES = 4 * 1024 * 1024
# What the API server and its network are expected to throw: logged without a traceback.
WATCH_ERRORS = (aiohttp.ClientError, TimeoutError, ConnectionError, ValueError, KeyError)
WATCH_TIMEOUT_S = 300  # the API server ends a watch after this; we then resume it


def _api_url(config: KubernetesConfig) -> str:
    if config.api_url:
        return config.api_url.rstrip("/")
    host, port = (
        os.environ.get("KUBERNETES_SERVICE_HOST"),
        os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
    )
    if not host:
        raise ConfigError("discovery.kubernetes.api_url: not set and not running in a pod")
    return f"https://{host}:{port}"


def slice_workers(item: dict[str, Any], port_name: str) -> list[WorkerConfig]:
    """The ready endpoints of one EndpointSlice, as workers. What is not shaped as the API
    documents it (a port that is not a number, an address that is not a string) is
    skipped, so one odd slice cannot stop discovery."""
    ports = _dicts(item.get("ports"))
    port = next((p.get("port") for p in ports if not port_name or p.get("name") == port_name), None)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return []
    workers = []
    for endpoint in _dicts(item.get("endpoints")):
        if _dict(endpoint.get("conditions")).get("ready") is False:
            continue
        addresses = [a for a in _list(endpoint.get("addresses")) if isinstance(a, str) and a]
        pod = _dict(endpoint.get("targetRef")).get("name")
        for address in addresses:
            host = f"[{address}]" if ":" in address else address
            name = pod if isinstance(pod, str) and pod and len(addresses) == 1 else None
            with contextlib.suppress(ConfigError, ValueError):
                workers.append(WorkerConfig(f"http://{host}:{port}", name=name or f"{host}:{port}"))
    return workers


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _dicts(value: object) -> list[dict[str, Any]]:
    return [v for v in _list(value) if isinstance(v, dict)]


def _metadata(item: object) -> dict[str, Any]:
    """An API object's metadata; ValueError when it has none (the watch starts over)."""
    metadata = item.get("metadata") if isinstance(item, dict) else None
    if not isinstance(metadata, dict):
        raise ValueError(f"an API object without metadata: {str(item)[:80]}")
    return metadata


def _name(item: object) -> str:
    name = _metadata(item).get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"an API object without a name: {str(item)[:80]}")
    return name


async def _lines(stream: aiohttp.StreamReader, limit: int) -> AsyncIterator[bytes]:
    """The stream's lines, each read whole however long, up to ``limit`` bytes (past it,
    ValueError)."""
    pending = bytearray()
    async for chunk in stream.iter_any():
        parts = chunk.split(b"\n")
        for i, part in enumerate(parts):
            pending += part
            if len(pending) > limit:
                raise ValueError(f"a watch line over {limit} bytes")
            if i < len(parts) - 1:  # a newline ended this part
                yield bytes(pending)
                pending.clear()
    if pending:
        yield bytes(pending)


class EndpointSliceSource:
    def __init__(self, config: KubernetesConfig, session: aiohttp.ClientSession) -> None:
        self._config = config
        self._session = session
        self._slices: dict[str, dict[str, Any]] = {}
        self._listed = False
        self._version: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._backoff = Backoff(BACKOFF_FIRST_S, BACKOFF_MAX_S)
        self._closed = False
        namespace = config.namespace
        if not namespace:
            ns_file = SERVICE_ACCOUNT / "namespace"
            namespace = ns_file.read_text().strip() if ns_file.exists() else "default"
        self._path = (
            f"{_api_url(config)}/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        )

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
            with contextlib.suppress(*WATCH_ERRORS):
                await self._list()  # the first answer comes from a list, not a watch
            self._start(delay_s=0.0)
        if not self._listed:
            return None  # not known yet: keep what is
        return [
            w for item in self._slices.values() for w in slice_workers(item, self._config.port_name)
        ]

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _start(self, delay_s: float) -> None:
        self._task = asyncio.create_task(self._run(delay_s), name="kvrouter-k8s-watch")
        self._task.add_done_callback(self._restart)

    def _restart(self, task: asyncio.Task[None]) -> None:
        """The watch task ended, which it only does on a failure: say why, and start over
        from a fresh list after a backoff."""
        if self._closed or task.cancelled():
            return
        exc = task.exception()
        delay_s = self._backoff.next()
        log.warning(
            "kubernetes discovery: the watch stopped: %r; relisting in %.1f s",
            exc,
            delay_s,
            exc_info=None if isinstance(exc, WATCH_ERRORS) else exc,
        )
        self._version = None
        self._start(delay_s)

    async def _run(self, delay_s: float) -> None:
        """List when there is no version to resume from, then watch, again and again; a
        failure ends the task (``_restart`` takes it from there)."""
        await asyncio.sleep(delay_s)
        while True:
            if self._version is None:
                await self._list()
            await self._watch()

    async def _list(self) -> None:
        params = {"labelSelector": self._config.selector}
        async with self._session.get(
            self._path, params=params, headers=self._headers(), ssl=self._ssl()
        ) as response:
            response.raise_for_status()
            body = orjson.loads(await response.read())
        items = _list(body.get("items") if isinstance(body, dict) else None)
        version = _metadata(body).get("resourceVersion")
        self._slices = {_name(item): item for item in items}
        self._listed = True
        self._version = str(version)

    async def _watch(self) -> None:
        """Follow changes from ``self._version``; returns when the watch ends (resume) or
        the server says the version is gone (``_version`` cleared: relist)."""
        params = {
            "labelSelector": self._config.selector,
            "watch": "1",
            "resourceVersion": self._version or "",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_read=WATCH_TIMEOUT_S + 30)
        async with self._session.get(
            self._path, params=params, headers=self._headers(), ssl=self._ssl(), timeout=timeout
        ) as response:
            response.raise_for_status()
            async for line in _lines(response.content, MAX_EVENT_BYTES):
                if line.strip() and not self._apply(orjson.loads(line)):
                    self._version = None  # 410 Gone or another error: relist
                    return
                self._backoff.reset()  # the watch works again

    def _apply(self, event: object) -> bool:
        """One watch event into the slices; False when the server says to relist."""
        item = event.get("object") if isinstance(event, dict) else None
        if not isinstance(event, dict) or not isinstance(item, dict):
            raise ValueError(f"a watch event without an object: {str(event)[:80]}")
        kind = event.get("type")
        if kind == "ERROR":
            log.info("kubernetes discovery: watch error %s; relisting", item.get("code"))
            return False
        metadata = _metadata(item)
        self._version = str(metadata.get("resourceVersion") or self._version)
        if kind == "BOOKMARK":
            return True
        name = _name(item)
        if kind == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = item
        return True
