"""HTTP helpers for the router's end-to-end tests: requests, SSE parsing, metrics, waits."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from bench.loopback import serve_on_loopback
from bench.textgen import text_for
from tests.conftest import (
    TEST_MODEL,
    EngineFactory,
    RunningEngine,
    RunningRouter,
)

BLOCK = 16  # the engines' KV block, in tokens
WORKER = "X-Kvrouter-Worker"
LOAD_GAUGES = (
    "kvrouter_worker_outstanding_requests",
    "kvrouter_worker_outstanding_tokens",
    "kvrouter_worker_queued_prefill_tokens",
)


# -- helpers -------------------------------------------------------------------------------


class Listening(Protocol):
    """A router the helpers talk to: in this process (``RunningRouter``) or not."""

    @property
    def url(self) -> str: ...


@dataclass(slots=True)
class Streamed:
    status: int
    headers: Mapping[str, str]
    raw: bytes
    text: str = ""
    usage: dict[str, Any] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)

    @property
    def worker(self) -> str | None:
        return self.headers.get(WORKER)

    @property
    def cached(self) -> int:
        assert self.usage is not None
        cached: int = self.usage["prompt_tokens_details"]["cached_tokens"]
        return cached


def parse_sse(raw: bytes) -> tuple[str, dict[str, Any] | None, list[dict[str, Any]]]:
    """Content, usage and error events of a chat SSE body."""
    text, usage, errors = "", None, []
    for line in raw.split(b"\n"):
        payload = line.removeprefix(b"data:").strip()
        if not line.startswith(b"data:") or payload == b"[DONE]":
            continue
        event = orjson.loads(payload)
        if "error" in event:
            errors.append(event["error"])
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            text += choice.get("delta", {}).get("content") or choice.get("text") or ""
    return text, usage, errors


def chat_body(
    messages: list[dict[str, Any]], max_tokens: int = 8, stream: bool = True, **extra: Any
) -> dict[str, Any]:
    body = {
        "model": TEST_MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
        **extra,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def post(
    http: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    path: str = "/v1/chat/completions",
) -> Streamed:
    """A whole request; a streamed body is parsed as SSE, a JSON one as a response."""
    async with http.post(url + path, json=body) as response:
        raw = await response.read()
        result = Streamed(response.status, response.headers, raw)
    if response.status == 200 and body.get("stream"):
        result.text, result.usage, result.errors = parse_sse(raw)
    elif response.status == 200:
        obj = orjson.loads(raw)
        choice = obj["choices"][0]
        result.text = choice["message"]["content"] if "message" in choice else choice["text"]
        result.usage = obj["usage"]
    return result


async def router_samples(
    http: aiohttp.ClientSession, router: Listening
) -> list[tuple[str, dict[str, str], float]]:
    async with http.get(router.url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    return [
        (s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
    ]


async def metric(http: aiohttp.ClientSession, router: Listening, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(
        v
        for n, lab, v in await router_samples(http, router)
        if n == name and labels.items() <= lab.items()
    )


async def load(http: aiohttp.ClientSession, router: RunningRouter) -> dict[str, float]:
    """Every worker's load gauges, as ``{"<gauge>{<worker>}": value}``."""
    return {
        f"{n}{{{lab['worker']}}}": v
        for n, lab, v in await router_samples(http, router)
        if n in LOAD_GAUGES
    }


async def assert_idle(
    http: aiohttp.ClientSession, router: RunningRouter, wait_s: float = 0.0
) -> None:
    """Every worker's outstanding requests, tokens and queued prefill are back to 0."""
    deadline = time.monotonic() + wait_s
    while True:
        values = await load(http, router)
        assert len(values) == len(LOAD_GAUGES) * len(router.config.workers)
        if not any(values.values()) or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.02)
    assert {k: v for k, v in values.items() if v} == {}


async def wait_for(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def set_faults(http: aiohttp.ClientSession, engine: RunningEngine, **faults: Any) -> None:
    async with http.post(engine.url + "/sim/faults", json=faults) as response:
        assert response.status == 200, await response.text()


@contextlib.asynccontextmanager
async def engines(
    factory: EngineFactory, count: int, **overrides: Any
) -> AsyncIterator[list[RunningEngine]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(factory(engine_id=str(i), **overrides))
            for i in range(count)
        ]


@contextlib.asynccontextmanager
async def held_stream(
    http: aiohttp.ClientSession, url: str, body: Mapping[str, Any]
) -> AsyncIterator[tuple[aiohttp.ClientResponse, bytes]]:
    """A streaming request whose first chunk has arrived; closed (abandoned) on exit."""
    response = await http.post(url + "/v1/chat/completions", json=body)
    try:
        assert response.status == 200, await response.text()
        yield response, await response.content.readany()
    finally:
        response.close()


def conversation(key: str, system_tokens: int, user_tokens: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": text_for(f"{key}-sys", system_tokens)},
        {"role": "user", "content": text_for(f"{key}-u0", user_tokens)},
    ]


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def whole_reply() -> web.Response:
    """A minimal non-streamed chat completion, with usage, as an engine answers it."""
    message = {"role": "assistant", "content": "ok"}
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    choices = [{"index": 0, "message": message}]
    body = {"id": "c", "object": "chat.completion", "usage": usage, "choices": choices}
    return web.json_response(body)


@contextlib.asynccontextmanager
async def fake_engine(chat: Handler, models: Handler | None = None) -> AsyncIterator[str]:
    """A stand-in engine whose chat endpoint is ``chat`` (and /v1/models ``models``, if
    given); health, models and an idle /metrics answer (a worker without fresh metrics
    counts as saturated)."""

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": TEST_MODEL}]})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", ok)
    app.router.add_get("/v1/models", models or ok)
    app.router.add_post("/v1/chat/completions", chat)
    async with serve_on_loopback(app) as url:
        yield url


async def session_turns(
    http: aiohttp.ClientSession,
    pick_url: Callable[[], str],
    key: str,
    turns: int,
    stream: Callable[[int], bool] = lambda turn: True,
) -> list[int]:
    """One session's turns, each sent to ``pick_url()`` 50 ms after the last returned;
    the status of each."""
    messages = conversation(key, 200, 100)
    statuses = []
    for turn in range(turns):
        body = chat_body(messages, max_tokens=8, stream=stream(turn))
        result = await post(http, pick_url(), body)
        statuses.append(result.status)
        if result.status == 200:
            messages += [
                {"role": "assistant", "content": result.text},
                {"role": "user", "content": f"turn {turn}"},
            ]
        await asyncio.sleep(0.05)
    return statuses
