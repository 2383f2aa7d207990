"""Worker discovery beyond the static list: a watched file and DNS.

Each source answers "which workers exist now"; the reconciler adds the new ones (their
capacity read from their /metrics) and removes the ones that left, every
``discovery.interval_s``, without a restart. Workers from the static list always stay.

* file: YAML or JSON, a list of worker URLs or ``{url, name?, kv_tokens?}`` mappings
  (the format of ``workers:`` in the config file); re-read when its modification time
  changes.
* dns: the A/AAAA records of a name (a Kubernetes headless service), one worker per
  address, on ``dns_port``; or, for a name starting with ``_``
  (``_http._tcp.vllm.ns.svc.cluster.local``), its SRV records, one worker per target and
  port. Re-resolved every interval.
* kubernetes: EndpointSlices by label selector, listed then watched
  (``router/kubernetes.py``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import aiohttp
import dns.asyncresolver
import dns.exception
import dns.resolver
import yaml

from router.config import DiscoveryConfig, WorkerConfig, build
from router.errors import ConfigError
from router.kubernetes import EndpointSliceSource
from router.provision import new_worker
from router.state import RouterState

log = logging.getLogger(__name__)

SRV_TIMEOUT_S = 2.0


class Source(Protocol):
    async def workers(self) -> list[WorkerConfig] | None:
        """The workers that exist now; None when the source cannot tell (keep what is)."""
        ...

    async def close(self) -> None:
        """Stop what the source runs in the background."""
        ...


class FileSource:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._mtime: float | None = None
        self._last: list[WorkerConfig] | None = None

    async def workers(self) -> list[WorkerConfig] | None:
        try:
            mtime = self._path.stat().st_mtime
        except OSError as exc:
            log.warning("discovery file %s unreadable: %s", self._path, exc)
            return None
        if mtime != self._mtime:
            self._mtime = mtime
            self._last = self._read()
        return self._last

    async def close(self) -> None:
        return None

    def _read(self) -> list[WorkerConfig] | None:
        try:
            entries = yaml.safe_load(self._path.read_text()) or []
            if not isinstance(entries, list):
                raise ConfigError("expected a list of workers")
            return [build(WorkerConfig, {"url": e} if isinstance(e, str) else e,
                          f"{self._path}[{i}]") for i, e in enumerate(entries)]
        except (OSError, yaml.YAMLError, ConfigError, TypeError) as exc:
            log.warning("discovery file %s ignored: %s", self._path, exc)
            return None


class DnsSource:
    def __init__(self, name: str, port: int, scheme: str = "http",
                 nameserver: str = "") -> None:
        self._name = name
        self._port = port
        self._scheme = scheme
        self._resolver = dns.asyncresolver.Resolver(configure=not nameserver)
        if nameserver:
            host, _, ns_port = nameserver.rpartition(":")
            self._resolver.nameservers = [host]
            self._resolver.port = int(ns_port)

    async def workers(self) -> list[WorkerConfig] | None:
        if self._name.startswith("_"):
            return await self._srv()
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self._name, self._port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("discovery: cannot resolve %s: %s", self._name, exc)
            return None
        addresses = sorted({str(info[4][0]) for info in infos})
        return [WorkerConfig(self._url(a)) for a in addresses]

    async def close(self) -> None:
        return None

    async def _srv(self) -> list[WorkerConfig] | None:
        """``_http._tcp.vllm.ns.svc.cluster.local``: one worker per SRV record, at its
        target and port, named after the target (a pod's stable DNS name)."""
        try:
            answer = await self._resolver.resolve(self._name, "SRV", lifetime=SRV_TIMEOUT_S)
        except dns.resolver.NXDOMAIN:
            return []
        except dns.exception.DNSException as exc:
            log.warning("discovery: SRV lookup of %s failed: %r", self._name, exc)
            return None
        workers = []
        for record in answer:
            target = record.target.to_text().rstrip(".")
            port = int(record.port)
            workers.append(WorkerConfig(self._url(target, port), name=f"{target}:{port}"))
        return workers

    def _url(self, address: str, port: int | None = None) -> str:
        host = f"[{address}]" if ":" in address else address
        return f"{self._scheme}://{host}:{port or self._port}"


def sources(config: DiscoveryConfig, session: aiohttp.ClientSession) -> list[Source]:
    found: list[Source] = []
    if config.file:
        found.append(FileSource(Path(config.file)))
    if config.dns:
        found.append(DnsSource(config.dns, config.dns_port, nameserver=config.dns_nameserver))
    if config.kubernetes.selector:
        found.append(EndpointSliceSource(config.kubernetes, session))
    return found


def desired(static: Sequence[WorkerConfig],
            discovered: Sequence[list[WorkerConfig] | None]) -> dict[str, WorkerConfig] | None:
    """Every worker that should exist, by name; None if any source could not tell."""
    if any(d is None for d in discovered):
        return None
    result = {w.name: w for w in static}
    for found in discovered:
        for worker in found or ():
            result.setdefault(worker.name, worker)
    return result


class Reconciler:
    """Adds the workers the sources name that the router lacks and removes the ones the
    sources dropped; workers from the static list or the admin API are never removed."""

    def __init__(self, state: RouterState, found: Sequence[Source]) -> None:
        self._state = state
        self._sources = found
        self.managed: set[str] = set()

    async def reconcile(self) -> None:
        state, router = self._state, self._state.router
        wanted = desired(state.config.workers, [await s.workers() for s in self._sources])
        if wanted is None:
            return
        for name in sorted(self.managed - set(wanted)):
            log.warning("discovery: worker %s is gone; removing it", name)
            router.remove_worker(name)
            self.managed.discard(name)
        added = False
        for name, config in wanted.items():
            if name in router.fleet.workers:
                continue
            worker, known = new_worker(state.config, config)
            router.add_worker(worker)
            self.managed.add(name)
            if state.prober is not None and not known:
                state.prober.discover_capacity(name)
            log.info("discovery: worker %s at %s added", name, worker.url)
            added = True
        if added and state.prober is not None:
            await state.prober.probe_all()

    async def run(self, interval_s: float) -> None:
        try:
            while True:
                await asyncio.sleep(interval_s)
                await self.reconcile()
        finally:
            for source in self._sources:
                await source.close()
