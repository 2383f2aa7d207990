"""Workers discovered from a watched file and from DNS, without a restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
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
