"""Worker discovery beyond the static list: a watched file and DNS.

Each source answers "which workers exist now"; the reconciler adds the new ones (their
capacity read from their /metrics) and removes the ones that left, every
``discovery.interval_s``, without a restart. A worker whose address changed under the same
name is removed and added again: a new engine, whose cache starts empty. Workers from the
static list always stay.

* file: YAML or JSON, a list of worker URLs or ``{url, name?, kv_tokens?}`` mappings
  (the format of ``workers:`` in the config file); re-read when its modification time
  changes.
* dns: the A/AAAA records of a name (a Kubernetes headless service), one worker per
  address, on ``dns_port``; or, for a name starting with ``_``
  (``_http._tcp.vllm.ns.svc.cluster.local``), its SRV records, one worker per target and
  port. Re-resolved every interval, from ``dns_nameserver`` when one is set. Only an
  answer with records changes the workers: a lookup that fails or finds nothing
  (NXDOMAIN included, which DNS servers answer for a moment while a service's endpoints
  change) keeps the ones it last named.
* kubernetes: EndpointSlices by label selector, listed then watched
  (``router/discovery/kubernetes.py``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import dns.asyncresolver
import dns.exception
import dns.resolver
import yaml

from router.config import DiscoveryConfig, WorkerConfig
from router.config_loader import build
from router.discovery.kubernetes import EndpointSliceSource
from router.errors import ConfigError
from router.state import RouterState

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 2.0


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
            return [
                build(WorkerConfig, {"url": e} if isinstance(e, str) else e, f"{self._path}[{i}]")
                for i, e in enumerate(entries)
            ]
        except (OSError, yaml.YAMLError, ConfigError, TypeError, ValueError) as exc:
            log.warning("discovery file %s ignored: %s", self._path, exc)
            return None


class DnsSource:
    """Workers from DNS. A lookup that fails or finds nothing keeps the workers: removing
    a worker drops what the router knows of its cache, while a dead worker costs only a
    health probe until it answers again."""

    def __init__(self, name: str, port: int, scheme: str = "http", nameserver: str = "") -> None:
        self._name = name
        self._port = port
        self._scheme = scheme
        self._own_nameserver = bool(nameserver)
        self._resolver = dns.asyncresolver.Resolver(configure=not nameserver)
        if nameserver:
            host, _, ns_port = nameserver.rpartition(":")
            self._resolver.nameservers = [host]
            self._resolver.port = int(ns_port)

    async def workers(self) -> list[WorkerConfig] | None:
        if self._name.startswith("_"):
            found = await self._srv()
        else:
            addresses = await (
                self._queried_addresses() if self._own_nameserver else self._system_addresses()
            )
            found = (
                None
                if addresses is None
                else [WorkerConfig(self._url(a)) for a in sorted(set(addresses))]
            )
        if found is not None and not found:
            log.warning("discovery: %s has no records; keeping the current workers", self._name)
            return None
        return found

    async def close(self) -> None:
        return None

    async def _system_addresses(self) -> list[str] | None:
        """From the system's resolver (``/etc/hosts`` and search domains included)."""
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self._name, self._port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("discovery: cannot resolve %s: %s", self._name, exc)
            return None
        return [str(info[4][0]) for info in infos]

    async def _queried_addresses(self) -> list[str] | None:
        """The name's A and AAAA records, from the configured nameserver."""
        found: list[str] = []
        for rdtype in ("A", "AAAA"):
            records = await self._lookup(rdtype)
            if records is None:
                return None
            found += [record.to_text() for record in records]
        return found

    async def _srv(self) -> list[WorkerConfig] | None:
        """``_http._tcp.vllm.ns.svc.cluster.local``: one worker per SRV record, at its
        target and port, named after the target (a pod's stable DNS name)."""
        records = await self._lookup("SRV")
        if records is None:
            return None
        workers = []
        for record in records:
            target = record.target.to_text().rstrip(".")
            port = int(record.port)
            workers.append(WorkerConfig(self._url(target, port), name=f"{target}:{port}"))
        return workers

    async def _lookup(self, rdtype: str) -> list[Any] | None:
        """The name's records of ``rdtype`` ([] if it has none of them), or None when the
        lookup failed (NXDOMAIN included: it is often transient)."""
        try:
            answer = await self._resolver.resolve(self._name, rdtype, lifetime=LOOKUP_TIMEOUT_S)
        except dns.resolver.NoAnswer:
            return []
        except dns.exception.DNSException as exc:
            log.warning("discovery: %s lookup of %s failed: %r", rdtype, self._name, exc)
            return None
        return list(answer)

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


def desired(
    static: Sequence[WorkerConfig], discovered: Sequence[list[WorkerConfig] | None]
) -> dict[str, WorkerConfig] | None:
    """Every worker that should exist, by name; None if any source could not tell."""
    if any(d is None for d in discovered):
        return None
    result = {w.name: w for w in static}
    for found in discovered:
        for worker in found or ():
            result.setdefault(worker.name, worker)
    return result


class Reconciler:
    """Adds the workers the sources name that the router lacks, removes the ones the
    sources dropped, and replaces the ones whose address changed; workers from the static
    list or the admin API are never touched."""

    def __init__(self, state: RouterState, found: Sequence[Source]) -> None:
        self._state = state
        self._sources = found
        self.managed: set[str] = set()

    async def reconcile(self) -> None:
        state = self._state
        wanted = desired(state.config.workers, [await _ask(s) for s in self._sources])
        if wanted is None:
            return
        for name in sorted(self.managed - set(wanted)):
            log.warning("discovery: worker %s is gone; removing it", name)
            self._remove(name)
        for name in self._moved(wanted):
            log.warning(
                "discovery: worker %s moved to %s; it starts with an empty cache",
                name,
                wanted[name].url,
            )
            self._remove(name)
        fleet = state.router.fleet
        fresh = [config for name, config in wanted.items() if name not in fleet.workers]
        for config in fresh:
            self._add(config)
        if fresh:
            await state.prober.probe_all()

    def _moved(self, wanted: dict[str, WorkerConfig]) -> list[str]:
        """Discovered workers whose name stays while their address changed."""
        workers = self._state.router.fleet.workers
        return sorted(
            name
            for name in self.managed & set(wanted)
            if name in workers and workers[name].url != wanted[name].url.rstrip("/")
        )

    def _remove(self, name: str) -> None:
        self._state.membership.remove(name)
        self.managed.discard(name)

    def _add(self, config: WorkerConfig) -> None:
        worker = self._state.add_worker(config)
        self.managed.add(worker.name)
        log.info("discovery: worker %s at %s added", worker.name, worker.url)

    async def run(self, interval_s: float) -> None:
        try:
            while True:
                await asyncio.sleep(interval_s)
                await self.reconcile()
        finally:
            for source in self._sources:
                await source.close()


async def _ask(source: Source) -> list[WorkerConfig] | None:
    """The source's workers; None (keep what is) when it fails in a way it did not expect,
    so one broken source never stops the reconciler for the others."""
    try:
        return await source.workers()
    except Exception:  # the reconciler's task must outlive any one source's bug
        log.warning(
            "discovery: %s failed; keeping the current workers",
            type(source).__name__,
            exc_info=True,
        )
        return None
