"""Workers discovered from a watched file and from DNS, without a restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import dns.message
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import yaml

from router.config import DiscoveryConfig
from router.state import STATE_KEY
from tests.conftest import EngineFactory, RunningRouter, router_config, serve_router
from tests.router_client import chat_body, engines, post, wait_for


def names(router: RunningRouter) -> set[str]:
    return set(router.app[STATE_KEY].router.fleet.workers)


async def test_workers_follow_the_file(engine_factory: EngineFactory, tmp_path: Path) -> None:
    listing = tmp_path / "workers.yaml"
    async with engines(engine_factory, 3) as fleet, aiohttp.ClientSession() as http:
        listing.write_text(yaml.safe_dump([{"url": fleet[1].url, "name": "f1"}]))
        config = router_config(fleet[:1], policy="round_robin",
                               discovery=DiscoveryConfig(file=str(listing), interval_s=0.05))
        async with serve_router(config) as router:
            assert names(router) == {"w0", "f1"}
            assert router.app[STATE_KEY].router.fleet.workers["f1"].capacity_tokens == 50_000
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
        config = router_config([], discovery=DiscoveryConfig(dns="localhost", dns_port=port,
                                                             interval_s=0.05))
        async with serve_router(config) as router:
            assert f"127.0.0.1:{port}" in names(router)
            body = chat_body([{"role": "user", "content": "hi"}], max_tokens=2)
            result = await post(http, router.url, body)
            assert result.status == 200 and result.worker == f"127.0.0.1:{port}"


class SrvServer(asyncio.DatagramProtocol):
    """A tiny authoritative DNS server on UDP loopback answering SRV queries."""

    def __init__(self, records: dict[str, list[tuple[str, int]]]) -> None:
        self.records = records
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # a datagram transport (not a DatagramTransport subclass)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        query = dns.message.from_wire(data)
        response = dns.message.make_response(query)
        question = query.question[0]
        name = question.name.to_text()
        if question.rdtype == dns.rdatatype.SRV and name in self.records:
            rrset = response.find_rrset(response.answer, question.name, dns.rdataclass.IN,
                                        dns.rdatatype.SRV, create=True)
            for target, port in self.records[name]:
                rrset.add(dns.rdata.from_text(dns.rdataclass.IN, dns.rdatatype.SRV,
                                              f"0 0 {port} {target}."), ttl=5)
        else:
            response.set_rcode(dns.rcode.NXDOMAIN)
        self.transport.sendto(response.to_wire(), addr)  # type: ignore[union-attr]


async def test_workers_from_srv_records(engine_factory: EngineFactory) -> None:
    async with engines(engine_factory, 2) as fleet, aiohttp.ClientSession() as http:
        ports = [int(e.url.rsplit(":", 1)[1]) for e in fleet]
        name = "_http._tcp.vllm.test."
        server = SrvServer({name: [("localhost", ports[0])]})
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: server,
                                                           local_addr=("127.0.0.1", 0))
        try:
            dns_port = transport.get_extra_info("sockname")[1]
            discovery = DiscoveryConfig(dns=name.rstrip("."), interval_s=0.05,
                                        dns_nameserver=f"127.0.0.1:{dns_port}")
            async with serve_router(router_config([], discovery=discovery)) as router:
                assert names(router) == {f"localhost:{ports[0]}"}
                server.records[name].append(("localhost", ports[1]))

                async def both() -> bool:
                    return names(router) == {f"localhost:{p}" for p in ports}
                await wait_for(both)
                body = chat_body([{"role": "user", "content": "hi"}], max_tokens=2)
                assert (await post(http, router.url, body)).status == 200
        finally:
            transport.close()
