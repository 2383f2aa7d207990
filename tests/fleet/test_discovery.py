"""Workers discovered from a watched file and from DNS, without a restart."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import dns.message
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import yaml

from router.config import DiscoveryConfig
from tests.conftest import EngineFactory, RunningRouter, router_config, serve_router
from tests.router_client import chat_body, conversation, engines, post, wait_for


def names(router: RunningRouter) -> set[str]:
    return set(router.state.router.fleet.workers)


async def test_workers_follow_the_file(engine_factory: EngineFactory, tmp_path: Path) -> None:
    listing = tmp_path / "workers.yaml"
    async with engines(engine_factory, 3) as fleet, aiohttp.ClientSession() as http:
        listing.write_text(yaml.safe_dump([{"url": fleet[1].url, "name": "f1"}]))
        config = router_config(
            fleet[:1],
            policy="round_robin",
            discovery=DiscoveryConfig(file=str(listing), interval_s=0.05),
        )
        async with serve_router(config) as router:
            assert names(router) == {"w0", "f1"}
            assert router.state.router.fleet.workers["f1"].capacity_tokens == 50_000
            listing.write_text(yaml.safe_dump([fleet[2].url]))  # f1 leaves, a new one comes

            async def changed() -> bool:
                return names(router) == {"w0", fleet[2].url.removeprefix("http://")}

            await wait_for(changed)
            body = chat_body([{"role": "user", "content": "hi"}], max_tokens=2)
            served = {(await post(http, router.url, body)).worker for _ in range(4)}
            assert served == names(router)
            listing.write_text("not: [a list")  # a broken file changes nothing
            await asyncio.sleep(0.2)
            assert len(names(router)) == 2


async def test_workers_from_dns(engine_factory: EngineFactory) -> None:
    async with engines(engine_factory, 1) as fleet, aiohttp.ClientSession() as http:
        port = int(fleet[0].url.rsplit(":", 1)[1])
        config = router_config(
            [], discovery=DiscoveryConfig(dns="localhost", dns_port=port, interval_s=0.05)
        )
        async with serve_router(config) as router:
            assert f"127.0.0.1:{port}" in names(router)
            body = chat_body([{"role": "user", "content": "hi"}], max_tokens=2)
            result = await post(http, router.url, body)
            assert result.status == 200 and result.worker == f"127.0.0.1:{port}"


class DnsServer(asyncio.DatagramProtocol):
    """A tiny authoritative DNS server on UDP loopback: ``records`` maps (name, type) to
    record texts; a name it lacks is NXDOMAIN, and so is every name while ``down``."""

    def __init__(self, records: dict[tuple[str, str], list[str]]) -> None:
        self.records = records
        self.down = False
        self.nxdomains = 0
        self.queries = 0
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # a datagram transport (not a DatagramTransport subclass)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.queries += 1
        query = dns.message.from_wire(data)
        response = dns.message.make_response(query)
        question = query.question[0]
        name, rdtype = question.name.to_text(), dns.rdatatype.to_text(question.rdtype)
        if self.down or all(n != name for n, _ in self.records):
            self.nxdomains += 1
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif texts := self.records.get((name, rdtype)):  # else a name without these
            rrset = response.find_rrset(
                response.answer, question.name, dns.rdataclass.IN, question.rdtype, create=True
            )
            for text in texts:
                rrset.add(dns.rdata.from_text(dns.rdataclass.IN, question.rdtype, text), ttl=5)
        self.transport.sendto(response.to_wire(), addr)  # type: ignore[union-attr]


def srv(target: str, port: int) -> str:
    return f"0 0 {port} {target}."


@contextlib.asynccontextmanager
async def dns_server(
    records: dict[tuple[str, str], list[str]],
) -> AsyncIterator[tuple[DnsServer, str]]:
    """The server, and its address as ``discovery.dns_nameserver`` takes it."""
    server = DnsServer(records)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: server, local_addr=("127.0.0.1", 0))
    try:
        yield server, f"127.0.0.1:{transport.get_extra_info('sockname')[1]}"
    finally:
        transport.close()


SRV_NAME = "_http._tcp.vllm.test."


async def test_workers_from_srv_records(engine_factory: EngineFactory) -> None:
    async with engines(engine_factory, 2) as fleet, aiohttp.ClientSession() as http:
        ports = [int(e.url.rsplit(":", 1)[1]) for e in fleet]
        async with dns_server({(SRV_NAME, "SRV"): [srv("localhost", ports[0])]}) as (
            server,
            nameserver,
        ):
            discovery = DiscoveryConfig(
                dns=SRV_NAME.rstrip("."), interval_s=0.05, dns_nameserver=nameserver
            )
            async with serve_router(router_config([], discovery=discovery)) as router:
                assert names(router) == {f"localhost:{ports[0]}"}
                server.records[SRV_NAME, "SRV"].append(srv("localhost", ports[1]))

                async def both() -> bool:
                    return names(router) == {f"localhost:{p}" for p in ports}

                await wait_for(both)
                body = chat_body([{"role": "user", "content": "hi"}], max_tokens=2)
                assert (await post(http, router.url, body)).status == 200


async def test_a_records_come_from_the_configured_nameserver(engine_factory: EngineFactory) -> None:
    async with engines(engine_factory, 1) as fleet, aiohttp.ClientSession() as http:
        port = int(fleet[0].url.rsplit(":", 1)[1])
        # Only this server knows the name (.test is reserved: no system resolver does).
        async with dns_server({("vllm.test.", "A"): ["127.0.0.1"]}) as (_, nameserver):
            discovery = DiscoveryConfig(
                dns="vllm.test", dns_port=port, interval_s=0.05, dns_nameserver=nameserver
            )
            async with serve_router(router_config([], discovery=discovery)) as router:
                assert names(router) == {f"127.0.0.1:{port}"}
                body = chat_body([{"role": "user", "content": "hi"}], max_tokens=2)
                result = await post(http, router.url, body)
                assert (result.status, result.worker) == (200, f"127.0.0.1:{port}")


async def test_a_failed_lookup_keeps_the_workers(engine_factory: EngineFactory) -> None:
    async with engines(engine_factory, 2) as fleet, aiohttp.ClientSession() as http:
        ports = [int(e.url.rsplit(":", 1)[1]) for e in fleet]
        records = {(SRV_NAME, "SRV"): [srv("localhost", p) for p in ports]}
        async with dns_server(records) as (server, nameserver):
            discovery = DiscoveryConfig(
                dns=SRV_NAME.rstrip("."), interval_s=0.05, dns_nameserver=nameserver
            )
            config = router_config([], discovery=discovery, policy="round_robin")
            async with serve_router(config) as router:
                for _ in ports:
                    await post(http, router.url, chat_body(conversation("dns", 200, 20)))
                workers = dict(router.state.router.fleet.workers)
                held = {name: resident(router, name) for name in workers}
                assert len(workers) == 2 and all(held.values())
                server.down = True  # a transient NXDOMAIN, seen by several lookups
                await wait_for(lambda: _at_least(lambda: server.nxdomains, 3))
                kept = router.state.router.fleet.workers
                assert all(kept.get(name) is worker for name, worker in workers.items())
                assert {name: resident(router, name) for name in workers} == held
                server.down = False
                server.records[SRV_NAME, "SRV"].pop()  # a real answer still changes things

                async def one() -> bool:
                    return names(router) == {f"localhost:{ports[0]}"}

                await wait_for(one)


async def test_a_worker_that_moves_is_replaced(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    listing = tmp_path / "workers.yaml"
    async with engines(engine_factory, 2) as fleet, aiohttp.ClientSession() as http:
        listing.write_text(yaml.safe_dump([{"url": fleet[0].url, "name": "f1"}]))
        config = router_config([], discovery=DiscoveryConfig(file=str(listing), interval_s=0.05))
        async with serve_router(config) as router:
            messages = conversation("moves", 400, 40)
            await post(http, router.url, chat_body(messages, max_tokens=2))
            again = await post(http, router.url, chat_body(messages, max_tokens=2))
            assert again.cached > 0 and resident(router, "f1") > 0
            listing.write_text(yaml.safe_dump([{"url": fleet[1].url, "name": "f1"}]))

            async def moved() -> bool:
                return router.state.router.fleet.workers["f1"].url == fleet[1].url

            await wait_for(moved)
            assert resident(router, "f1") == 0  # a new engine: nothing cached there yet
            after = await post(http, router.url, chat_body(messages, max_tokens=2))
            assert (after.status, after.worker, after.cached) == (200, "f1", 0)


def resident(router: RunningRouter, worker: str) -> int:
    return router.state.router.index.resident_blocks(worker)


async def _at_least(value: Callable[[], int], minimum: int) -> bool:
    return value() >= minimum


async def test_a_source_that_breaks_does_not_stop_discovery(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    listing = tmp_path / "workers.yaml"
    async with engines(engine_factory, 2) as fleet:
        ports = [int(e.url.rsplit(":", 1)[1]) for e in fleet]
        listing.write_text(yaml.safe_dump([{"url": fleet[0].url, "name": "f0"}]))
        async with dns_server({(SRV_NAME, "SRV"): [srv("localhost", ports[0])]}) as (
            server,
            nameserver,
        ):
            discovery = DiscoveryConfig(
                file=str(listing),
                dns=SRV_NAME.rstrip("."),
                interval_s=0.05,
                dns_nameserver=nameserver,
            )
            async with serve_router(router_config([], discovery=discovery)) as router:
                assert names(router) == {"f0", f"localhost:{ports[0]}"}
                listing.write_text("- http://[not-an-address\n")  # no URL
                server.records[SRV_NAME, "SRV"] = [srv("", ports[1])]  # target ".": none
                asked = server.queries
                await wait_for(lambda: _at_least(lambda: server.queries, asked + 3))
                assert names(router) == {"f0", f"localhost:{ports[0]}"}
                listing.write_text(yaml.safe_dump([{"url": fleet[1].url, "name": "f1"}]))
                server.records[SRV_NAME, "SRV"] = [srv("localhost", ports[1])]

                async def followed() -> bool:
                    return names(router) == {"f1", f"localhost:{ports[1]}"}

                await wait_for(followed)
