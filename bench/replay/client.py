"""One streaming chat completion against an OpenAI-compatible endpoint, timed.

Every failure (an HTTP status other than 200, a connection error, a timeout, an error
event inside the stream, a stream that stops before ``[DONE]``) is returned in the
outcome rather than raised: the replay records it and carries on.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson

from bench.replay.sse import iter_sse
from router.clock import monotonic

WORKER_HEADER = "x-kvrouter-worker"
# How requests are spread over several router replicas.
Assign = Literal["random", "round_robin"]
ASSIGNS: tuple[Assign, ...] = ("random", "round_robin")
SESSION_HEADER = "X-Session-Id"
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_REQUEST_TIMEOUT_S = 600.0
# Error bodies are only kept for the record; a page of HTML is not worth more.
MAX_ERROR_CHARS = 300


class ModelDiscoveryError(RuntimeError):
    """GET /v1/models failed or listed no model."""


@dataclass(frozen=True, slots=True)
class ChatRequest:
    session: str
    messages: tuple[Mapping[str, str], ...]
    max_tokens: int


@dataclass(slots=True)
class StreamOutcome:
    """What came back; times are wall-clock seconds from sending the request."""

    status: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    reply: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    worker: str | None = None
    error: str | None = None


def open_http_session(
    limit: int,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
) -> aiohttp.ClientSession:
    """One pooled session for the whole run, at most ``limit`` connections."""
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def discover_model(http: aiohttp.ClientSession, target: str) -> str:
    """The first model id the endpoint lists."""
    try:
        async with http.get(f"{target}/v1/models") as resp:
            if resp.status != 200:
                raise ModelDiscoveryError(f"GET {target}/v1/models: HTTP {resp.status}")
            body = await resp.json(loads=orjson.loads)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ModelDiscoveryError(f"GET {target}/v1/models: {exc!r}") from exc
    models = body.get("data") if isinstance(body, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise ModelDiscoveryError(f"{target}/v1/models lists no model")
    return str(models[0]["id"])


def _body(model: str, request: ChatRequest) -> dict[str, Any]:
    return {
        "model": model,
        "messages": list(request.messages),
        "max_tokens": request.max_tokens,
        # vLLM extension: generate exactly max_tokens, so replies match the trace.
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": request.session,
    }


def stream_error(chunk: Any) -> str | None:
    """The message of an in-stream error chunk (vLLM and SGLang shapes), else None."""
    if not isinstance(chunk, dict):
        return "malformed chunk"
    error = chunk.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, dict) else error
        return f"stream error: {message}"
    if chunk.get("object") == "error":
        return f"stream error: {chunk.get('message')}"
    return None


def _apply_chunk(
    outcome: StreamOutcome, chunk: dict[str, Any], elapsed: float, parts: list[str]
) -> None:
    for choice in chunk.get("choices") or ():
        content = (choice.get("delta") or {}).get("content")
        if content:
            if outcome.ttft_s is None:
                outcome.ttft_s = elapsed
            parts.append(content)
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        outcome.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        outcome.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        outcome.cached_tokens = int(details.get("cached_tokens") or 0)


async def _read_stream(
    resp: aiohttp.ClientResponse, outcome: StreamOutcome, t0: float, parts: list[str]
) -> None:
    async for event in iter_sse(resp.content):
        if event.data.strip() == "[DONE]":
            return
        try:
            chunk = orjson.loads(event.data)
        except orjson.JSONDecodeError:
            outcome.error = f"undecodable chunk: {event.data[:MAX_ERROR_CHARS]}"
            return
        outcome.error = stream_error(chunk)
        if event.event == "error" and outcome.error is None:
            outcome.error = f"stream error: {event.data[:MAX_ERROR_CHARS]}"
        if outcome.error is not None:
            return
        _apply_chunk(outcome, chunk, monotonic() - t0, parts)
    outcome.error = "stream ended before [DONE]"


class ChatClient:
    """Sends chat requests for one model through a shared pooled session.

    With several targets (router replicas behind no load balancer), each request goes
    to the next one (``assign="round_robin"``) or to one picked at random, as a load
    balancer in front of replicas without affinity would do.
    """

    __slots__ = ("_assign", "_http", "_model", "_next", "_rng", "_urls")

    def __init__(
        self,
        http: aiohttp.ClientSession,
        target: str,
        model: str,
        more_targets: Sequence[str] = (),
        seed: int = 0,
        assign: Assign = "random",
    ) -> None:
        self._http = http
        self._model = model
        self._urls = [f"{t.rstrip('/')}/v1/chat/completions" for t in (target, *more_targets)]
        self._rng = random.Random(seed)
        self._assign = assign
        self._next = 0

    def _url(self) -> str:
        urls = self._urls
        if len(urls) == 1:
            return urls[0]
        if self._assign == "random":
            return self._rng.choice(urls)
        self._next = (self._next + 1) % len(urls)
        return urls[self._next]

    async def stream_chat(self, request: ChatRequest) -> StreamOutcome:
        outcome = StreamOutcome()
        parts: list[str] = []
        headers = {SESSION_HEADER: request.session, "Content-Type": "application/json"}
        t0 = monotonic()
        try:
            url = self._url()
            async with self._http.post(
                url, data=orjson.dumps(_body(self._model, request)), headers=headers
            ) as resp:
                outcome.status = resp.status
                outcome.worker = resp.headers.get(WORKER_HEADER)
                if resp.status != 200:
                    head = await resp.content.read(MAX_ERROR_CHARS)
                    text = head.decode("utf-8", errors="replace")
                    outcome.error = f"HTTP {resp.status}: {text}"
                else:
                    await _read_stream(resp, outcome, t0, parts)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            # ValueError: aiohttp's reader refuses a line longer than its buffer.
            outcome.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        outcome.latency_s = monotonic() - t0
        outcome.reply = "".join(parts)
        return outcome
