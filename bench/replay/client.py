"""One streamed reply to a chat turn, timed, through one of the APIs the replay speaks:
OpenAI's Chat Completions, OpenAI's Responses or Anthropic's Messages (the bodies in
``bench.workloads.api_bodies``, reading the streams in ``bench.replay.api_streams``).

Every failure (an HTTP status other than 200, a connection error, a timeout, an error
event inside the stream, a stream that stops before its end) is returned in the
outcome rather than raised: the replay records it and carries on.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Literal

import aiohttp
import orjson

from bench.replay.api_streams import MAX_ERROR_CHARS, READERS, StreamOutcome, StreamReader
from bench.replay.sse import iter_sse
from bench.workloads.api_bodies import BODIES, DEFAULT_API, PATHS, Api, ChatRequest
from router.clock import monotonic
from router.wire.headers import (
    RETRY_AFTER_HEADER,
    RETRY_AFTER_MS_HEADER,
    SESSION_HEADER,
    WORKER_HEADER,
)
from router.wire.sessions import PARENT_SESSION_HEADER

# How requests are spread over several router replicas.
Assign = Literal["random", "round_robin"]
ASSIGNS: tuple[Assign, ...] = ("random", "round_robin")
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_REQUEST_TIMEOUT_S = 600.0


class ModelDiscoveryError(RuntimeError):
    """GET /v1/models failed or listed no model."""


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


async def _read_stream(resp: aiohttp.ClientResponse, reader: StreamReader, t0: float) -> None:
    async for event in iter_sse(resp.content):
        if reader.feed(event, monotonic() - t0):
            return
    reader.outcome.error = reader.end_missing


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """When a refusal says to send again, as the OpenAI and Anthropic SDKs read it: the
    first of ``retry-after-ms`` and ``Retry-After`` (seconds) that is a number, whatever
    its sign (the caller decides what it takes); an HTTP date is not read: None.
    ``headers`` is looked up as named here: aiohttp's are case-insensitive."""
    for name, unit_s in ((RETRY_AFTER_MS_HEADER, 0.001), (RETRY_AFTER_HEADER, 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return float(value) * unit_s
        except ValueError:
            continue
    return None


class ChatClient:
    """Sends chat turns for one model over a shared pooled session, each through the API
    its request names (``ChatRequest.api``), or the client's default ``api``.

    With several targets (router replicas behind no load balancer), each request goes
    to the next one (``assign="round_robin"``) or to one picked at random, as a load
    balancer in front of replicas without affinity would do.
    """

    __slots__ = ("_api", "_assign", "_bases", "_http", "_model", "_next", "_rng")

    def __init__(
        self,
        http: aiohttp.ClientSession,
        target: str,
        model: str,
        more_targets: Sequence[str] = (),
        seed: int = 0,
        assign: Assign = "random",
        api: Api = DEFAULT_API,
    ) -> None:
        self._http = http
        self._model = model
        self._api = api
        self._bases = [t.rstrip("/") for t in (target, *more_targets)]
        self._rng = random.Random(seed)
        self._assign = assign
        self._next = 0

    def _url(self, api: Api | None = None) -> str:
        return f"{self._base()}{PATHS[api or self._api]}"

    def _base(self) -> str:
        bases = self._bases
        if len(bases) == 1:
            return bases[0]
        if self._assign == "random":
            return self._rng.choice(bases)
        self._next = (self._next + 1) % len(bases)
        return bases[self._next]

    async def stream_chat(self, request: ChatRequest) -> StreamOutcome:
        api = request.api or self._api
        outcome = StreamOutcome()
        reader = READERS[api](outcome)
        body = BODIES[api](self._model, request)
        headers = {SESSION_HEADER: request.session, "Content-Type": "application/json"}
        if request.parent is not None:
            headers[PARENT_SESSION_HEADER] = request.parent
        t0 = monotonic()
        try:
            url = self._url(api)
            async with self._http.post(url, data=orjson.dumps(body), headers=headers) as resp:
                outcome.status = resp.status
                outcome.worker = resp.headers.get(WORKER_HEADER)
                if resp.status != 200:
                    outcome.retry_after_s = retry_after_s(resp.headers)
                    head = await resp.content.read(MAX_ERROR_CHARS)
                    text = head.decode("utf-8", errors="replace")
                    outcome.error = f"HTTP {resp.status}: {text}"
                else:
                    await _read_stream(resp, reader, t0)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            # ValueError: aiohttp's reader refuses a line longer than its buffer.
            outcome.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        outcome.latency_s = monotonic() - t0
        outcome.reply = reader.reply()
        return outcome
