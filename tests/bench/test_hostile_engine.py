"""What the engine-side fuzz (tests/bench/test_fuzz_engine.py, ``kvrouter bench fuzz --side
engine``) found, each a fixed case of ``bench.fuzz.hostile_engine`` behind a served router."""

from __future__ import annotations

import asyncio
import http.client
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from bench.fuzz.engine_inputs import EngineCase, Reply
from bench.fuzz.engine_side import HOSTILE_MODEL
from bench.fuzz.hostile_engine import HostileEngine, hostile_engine
from bench.fuzz.watch import metric_total, metrics_page
from router.config import HealthConfig, KvEventsEndpoints, PrefixConfig, WorkerConfig
from tests.conftest import RunningRouter, router_config, serve_router
from tests.router_client import wait_for


@pytest.fixture
async def hostile() -> AsyncIterator[tuple[HostileEngine, RunningRouter]]:
    async with hostile_engine(HOSTILE_MODEL) as engine:
        config = router_config([], workers=(WorkerConfig(engine.url, name="hostile"),))
        async with serve_router(config) as running:
            yield engine, running


def _completion() -> bytes:
    return orjson.dumps(
        {
            "id": "c",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        }
    )


def _answer(extra_headers: list[bytes], body: bytes) -> Reply:
    head = [b"HTTP/1.1 200 OK", b"Content-Type: application/json", *extra_headers]
    head.append(b"Content-Length: %d" % len(body))
    return Reply((b"\r\n".join(head) + b"\r\n\r\n" + body,))


def _chat(url: str) -> tuple[int, list[tuple[str, str]], bytes]:
    """A chat request with Python's own HTTP client, which refuses a head of over 100
    header lines."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = orjson.dumps({"model": HOSTILE_MODEL, "messages": [{"role": "user", "content": "x"}]})
    try:
        connection.request(
            "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        return response.status, response.getheaders(), response.read()
    finally:
        connection.close()


async def test_an_engine_with_a_hundred_headers_cannot_make_its_answer_unreadable(
    hostile: tuple[HostileEngine, RunningRouter],
) -> None:
    engine, router = hostile
    many = [b"X-Engine-%d: v" % i for i in range(99)]
    engine.case = EngineCase(_answer(many, _completion()))
    status, headers, body = await asyncio.to_thread(_chat, router.url)
    assert status == 200 and orjson.loads(body)["choices"][0]["message"]["content"] == "hi"
    assert len(headers) <= 100


async def test_an_engine_cannot_speak_for_the_router_in_its_own_headers(
    hostile: tuple[HostileEngine, RunningRouter],
) -> None:
    engine, router = hostile
    spoofed = [b"X-Kvrouter-Worker: someone-else", b"X-Request-Id: not-yours"]
    engine.case = EngineCase(_answer(spoofed, _completion()))
    status, headers, _ = await asyncio.to_thread(_chat, router.url)
    assert status == 200
    named = [(k.lower(), v) for k, v in headers]
    assert named.count(("x-kvrouter-worker", "hostile")) == 1
    assert ("x-kvrouter-worker", "someone-else") not in named
    assert [k for k, _ in named].count("x-request-id") == 1
    assert ("x-request-id", "not-yours") not in named


async def test_malformed_kv_events_are_each_counted_but_not_each_logged(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every malformed batch logged a WARNING: an engine could write the router's log
    as fast as it could publish."""
    async with hostile_engine(HOSTILE_MODEL) as engine:
        endpoints = KvEventsEndpoints(engine.kv_endpoint, engine.replay_endpoint)
        config = router_config(
            [],
            workers=(WorkerConfig(engine.url, name="hostile", kv_events=endpoints),),
            prefix=PrefixConfig(tokenizer=str(model_dir)),
        )
        caplog.set_level(logging.WARNING)
        async with serve_router(config) as router:
            port = int(router.url.rsplit(":", 1)[1])

            async def resets_past(floor: float) -> bool:
                page = await asyncio.to_thread(metrics_page, port)
                total = metric_total(page, "kvrouter_kv_event_resets_total", reason="malformed")
                return total > floor

            await engine.publish((b"", b"next", b"not msgpack"))  # the subscription is up
            await wait_for(lambda: resets_past(0))
            for _ in range(300):
                await engine.publish((b"", b"next", b"not msgpack"))
            await wait_for(lambda: resets_past(300))
    logged = [r for r in caplog.records if "dropping its announced blocks" in r.getMessage()]
    assert 1 <= len(logged) <= 2


def _page(text: bytes) -> Reply:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n"
    return Reply((head % len(text) + text,))


async def test_a_kv_capacity_past_any_engines_is_capped_and_counted() -> None:
    """A worker's /metrics sized the router's index: num_gpu_blocks of 2^60 let the index
    hold as many blocks as that worker would ever announce."""
    async with hostile_engine(HOSTILE_MODEL) as engine:
        claim = b'vllm:cache_config_info{block_size="16",num_gpu_blocks="%d"} 1.0\n' % 2**60
        engine.case = EngineCase(_answer([], _completion()), metrics=_page(claim))
        config = router_config([], workers=(WorkerConfig(engine.url, name="hostile"),))
        async with serve_router(config) as router:
            port = int(router.url.rsplit(":", 1)[1])
            page = await asyncio.to_thread(metrics_page, port)
    assert metric_total(page, "kvrouter_worker_capacity_tokens", worker="hostile") == 1 << 28
    assert metric_total(page, "kvrouter_worker_reads_refused_total", what="capacity") == 1


async def test_metrics_pages_the_router_cannot_use_are_counted() -> None:
    async with hostile_engine(HOSTILE_MODEL) as engine:
        engine.case = EngineCase(_answer([], _completion()), metrics=Reply((b"\xff\xfe junk",)))
        config = router_config(
            [],
            workers=(WorkerConfig(engine.url, name="hostile"),),
            health=HealthConfig(interval_s=60.0, scrape_interval_s=0.05, stale_after_s=5.0),
        )
        async with serve_router(config) as router:
            port = int(router.url.rsplit(":", 1)[1])

            async def counted() -> bool:
                page = await asyncio.to_thread(metrics_page, port)
                return metric_total(page, "kvrouter_worker_reads_refused_total", what="metrics") > 1

            await wait_for(counted)


async def test_a_passed_through_answer_carries_the_clients_request_id_not_the_engines(
    hostile: tuple[HostileEngine, RunningRouter],
) -> None:
    engine, router = hostile
    body = orjson.dumps({"tokens": [1, 2], "count": 2})
    engine.case = EngineCase(_answer([b"X-Request-Id: the-engines"], body))
    host, port = router.url.removeprefix("http://").split(":")

    def tokenize() -> list[tuple[str, str]]:
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            payload = orjson.dumps({"model": HOSTILE_MODEL, "prompt": "x"})
            headers = {"Content-Type": "application/json", "X-Request-Id": "the-clients"}
            connection.request("POST", "/tokenize", payload, headers)
            response = connection.getresponse()
            response.read()
            assert response.status == 200
            return [(k.lower(), v) for k, v in response.getheaders()]
        finally:
            connection.close()

    headers = await asyncio.to_thread(tokenize)
    assert [v for k, v in headers if k == "x-request-id"] == ["the-clients"]


async def test_an_interim_answer_is_a_failed_attempt_not_the_clients_answer(
    hostile: tuple[HostileEngine, RunningRouter],
) -> None:
    """The long engine-side fuzz: "HTTP/1.1 100 OK" and then nothing was passed on as
    the status; the client (waiting, as HTTP says, for a final answer) got none."""
    engine, router = hostile
    engine.case = EngineCase(
        Reply((b"HTTP/1.1 100 OK\r\nContent-Type: application/json\r\nContent-Length: 0\r\n\r\n",))
    )
    status, _, body = await asyncio.to_thread(_chat, router.url)
    assert status == 502, body
    assert orjson.loads(body)["error"]["message"]
