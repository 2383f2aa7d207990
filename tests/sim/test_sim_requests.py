"""``GET /sim/requests``: each request's cached prefix when it arrived and when it was
scheduled, over real loopback HTTP behind both front-ends, and the bounded log behind it.

Prompts are given as stand-in token ids, so their blocks are known exactly: 16 tokens a
block, and a prompt shares a block with another only if all its 16 ids are the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest

from bench.sim.request_log import RequestLog, RequestRecord
from tests.conftest import engine_config
from tests.router_client import set_faults, wait_for
from tests.sim_servers import FRONTS, serve_engine_on

BLOCK = 16


async def complete(
    http: aiohttp.ClientSession, url: str, ids: Sequence[int], request_id: str | None = None
) -> dict[str, Any]:
    """A one-token completion of the prompt ``ids``; its usage."""
    headers = {} if request_id is None else {"X-Request-Id": request_id}
    body = {"prompt": list(ids), "max_tokens": 1, "ignore_eos": True}
    async with http.post(f"{url}/v1/completions", json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        usage: dict[str, Any] = (await response.json())["usage"]
        return usage


async def records(http: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with http.get(f"{url}/sim/requests") as response:
        assert response.status == 200, await response.text()
        kept: list[dict[str, Any]] = (await response.json())["requests"]
        return kept


async def until_recorded(http: aiohttp.ClientSession, url: str, count: int) -> None:
    """Until the engine has taken ``count`` requests (a record is made at submit)."""

    async def taken() -> bool:
        return len(await records(http, url)) >= count

    await wait_for(taken)


def cached(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("front", FRONTS)
async def test_a_shared_prefix_is_cached_at_arrival_and_at_schedule(front: str) -> None:
    first = list(range(1, 41))  # two full blocks and a partial one
    shares_two = [*first[: 2 * BLOCK], *range(1000, 1020)]
    whole_two = first[: 2 * BLOCK]  # all of it cached: the last block is computed again
    async with (
        serve_engine_on(front, engine_config()) as sim,
        aiohttp.ClientSession() as http,
    ):
        await complete(http, sim.url, first)
        usage = await complete(http, sim.url, shares_two, request_id="abc")
        capped = await complete(http, sim.url, whole_two, request_id="cap")
        kept = await records(http, sim.url)
    assert [r["request_id"] for r in kept] == [None, "abc", "cap"]
    assert [r["prompt_tokens"] for r in kept] == [40, 52, 32]
    assert kept[0]["cached_at_arrival"] == kept[0]["cached_at_schedule"] == 0
    abc = kept[1]
    assert abc["cached_at_arrival"] == abc["cached_at_schedule"] == 2 * BLOCK
    assert cached(usage) == abc["cached_at_schedule"]
    # At arrival too, a hit leaves at least one prompt token to compute.
    assert kept[2]["cached_at_arrival"] == kept[2]["cached_at_schedule"] == BLOCK
    assert cached(capped) == BLOCK
    assert abc["arrived"] <= abc["scheduled"]
    assert kept[0]["arrived"] < abc["arrived"] < kept[2]["arrived"]


@pytest.mark.parametrize("front", FRONTS)
async def test_a_prefix_evicted_while_queued_was_cached_at_arrival_only(front: str) -> None:
    """16 blocks. A finished request leaves 4 cached; while the engine is stalled a
    request that needs all 16 queues, then one that starts with those 4. When the
    stall lifts the first takes every block (the cached ones last, but it needs them),
    so the second, cached at arrival, finds nothing when it is scheduled."""
    blocks = 16
    prefix = list(range(1, 4 * BLOCK + 1))
    long = list(range(5000, 5000 + blocks * BLOCK - 1))  # one token left for the reply
    config = engine_config(kv_tokens=blocks * BLOCK)
    async with serve_engine_on(front, config) as sim, aiohttp.ClientSession() as http:
        await complete(http, sim.url, prefix)
        await set_faults(http, sim, stall=True)
        ahead = asyncio.create_task(complete(http, sim.url, long, request_id="long"))
        await until_recorded(http, sim.url, 2)
        queued = asyncio.create_task(
            complete(http, sim.url, [*prefix, *range(9000, 9016)], request_id="queued")
        )
        await until_recorded(http, sim.url, 3)
        await set_faults(http, sim, stall=False)
        await ahead
        usage = await queued
        kept = await records(http, sim.url)
    first, big, late = kept
    assert late["request_id"] == "queued" and big["request_id"] == "long"
    assert late["cached_at_arrival"] == 4 * BLOCK
    assert late["cached_at_schedule"] == cached(usage) == 0
    assert big["cached_at_arrival"] == big["cached_at_schedule"] == 0
    assert big["scheduled"] < late["scheduled"]
    assert first["cached_at_arrival"] == 0


@pytest.mark.parametrize("front", FRONTS)
async def test_a_restart_empties_the_records(front: str) -> None:
    async with (
        serve_engine_on(front, engine_config()) as sim,
        aiohttp.ClientSession() as http,
    ):
        await complete(http, sim.url, range(1, 20), request_id="before")
        before = await records(http, sim.url)
        async with http.post(f"{sim.url}/sim/restart") as response:
            assert response.status == 200
        after = await records(http, sim.url)
        await complete(http, sim.url, range(1, 20), request_id="after")
        again = await records(http, sim.url)
    assert [r["request_id"] for r in before] == ["before"]
    assert after == []
    # The restart emptied the cache as well: nothing cached at arrival.
    assert [(r["request_id"], r["cached_at_arrival"]) for r in again] == [("after", 0)]


def test_the_log_keeps_the_last_records_oldest_first() -> None:
    log = RequestLog(limit=3)
    for n in range(5):
        log.add(RequestRecord(f"r{n}", n, 0, float(n)))
    kept = log.as_dict()["requests"]
    assert [r["request_id"] for r in kept] == ["r2", "r3", "r4"]
    assert kept[0] == {
        "request_id": "r2",
        "prompt_tokens": 2,
        "cached_at_arrival": 0,
        "cached_at_schedule": None,
        "loaded": 0,
        "arrived": 2.0,
        "scheduled": None,
        "first_token": None,
    }


def test_a_request_id_that_is_not_utf8_is_listed_with_replacement_characters() -> None:
    # How both front-ends decode header bytes that are not UTF-8.
    header = b"id-\xff".decode("utf-8", "surrogateescape")
    log = RequestLog()
    log.add(RequestRecord(header, 1, 0, 0.0))
    assert log.as_dict()["requests"][0]["request_id"] == "id-\ufffd"
