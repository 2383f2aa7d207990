"""The engine endpoints that are forwarded without prefix work: a worker chosen by load
(``count_tokens``, embeddings, ``/tokenize``, ``/detokenize``), or the one worker that
stored a response (``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``).

Nothing of these enters the index or the learning; each holds a lease on its worker
while it runs, so the load the policies see counts it. A worker that cannot be reached,
or answers 5xx, before anything reached the client is replaced by the next least
loaded, up to ``upstream.max_attempts``; a stored response has one worker, and its
failure is the client's answer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from router.errors import (
    ModelNotFound,
    NoEligibleWorker,
    RouterError,
    UpstreamError,
    UpstreamTimeout,
)
from router.proxy import (
    FORWARDED_HEADERS,
    REQUEST_ID_HEADER,
    UPSTREAM_ERRORS,
    WORKER_HEADER,
    passed_on,
)
from router.state import STATE_KEY, RouterState
from router.upstream import ConnectFailed, UpstreamResponse
from router.workers import Lease, Worker

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _model_of(raw: bytes) -> str | None:
    """The body's ``model``, if it names one (the engine judges the rest)."""
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model else None


def least_loaded(state: RouterState, model: str | None, tried: list[str]) -> Worker:
    fleet = state.router.fleet
    if model is not None and not fleet.serves(model):
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    if model is not None:
        candidates = state.router.eligible(model, tried)
    else:
        candidates = [
            w for w in fleet.all() if w.healthy and not w.draining and w.name not in tried
        ]
    if not candidates:
        raise NoEligibleWorker("no healthy worker can take this request")
    return min(candidates, key=lambda w: (w.outstanding_requests + w.remote_requests, w.name))


def _headers_for_engine(http: web.Request, state: RouterState) -> bytes:
    lines = [
        b"%s: %s\r\n" % (name, value)
        for name, value in http.raw_headers
        if name.lower() in FORWARDED_HEADERS or name.lower() == REQUEST_ID_HEADER.lower()
    ]
    return b"".join(lines) + state.upstream_auth


async def _open(
    state: RouterState, worker: Worker, http: web.Request, raw: bytes
) -> UpstreamResponse:
    path = http.raw_path.encode("latin-1")
    headers = _headers_for_engine(http, state)
    try:
        return await state.upstream.send(
            worker.origin, path, headers, raw, http.method.encode("latin-1")
        )
    except TimeoutError as exc:
        raise UpstreamTimeout(f"worker {worker.name} timed out") from exc
    except ConnectionError as exc:
        if isinstance(exc, ConnectFailed):
            state.mark_unreachable(worker)
        raise UpstreamError(f"worker {worker.name} unreachable: {exc}") from exc


async def _relay(
    http: web.Request, upstream: UpstreamResponse, worker: Worker, state: RouterState
) -> web.StreamResponse:
    """The worker's answer, streamed on as it comes."""
    response = web.StreamResponse(status=upstream.status)
    for name, value in passed_on(upstream.headers):
        response.headers.add(name.decode("latin-1"), value.decode("latin-1"))
    request_id = http.headers.get(REQUEST_ID_HEADER.decode())
    if request_id is not None:  # the client's own, as the engine was sent it
        response.headers[REQUEST_ID_HEADER.decode()] = request_id
    if state.config.worker_header:
        response.headers[WORKER_HEADER.decode()] = worker.name
    await response.prepare(http)
    try:
        while chunk := await upstream.read_chunk():
            await response.write(chunk)
    except UPSTREAM_ERRORS as exc:
        log.warning("worker %s failed while relaying %s: %r", worker.name, http.path, exc)
        raise ConnectionResetError("the worker failed mid-answer") from exc
    await response.write_eof()
    return response


async def forward(
    http: web.Request, state: RouterState, choose: Callable[[list[str]], Worker], retry: bool
) -> web.StreamResponse:
    raw = await http.read()
    tried: list[str] = []
    attempts = state.config.upstream.max_attempts if retry else 1
    failure: RouterError | None = None
    for _ in range(attempts):
        try:
            worker = choose(tried)
        except NoEligibleWorker:
            if failure is None:
                raise
            break
        lease = Lease(worker, 0, 0)
        try:
            try:
                upstream = await _open(state, worker, http, raw)
            except (UpstreamError, UpstreamTimeout) as exc:
                failure = exc
                tried.append(worker.name)
                continue
            try:
                if upstream.status >= 500 and retry and len(tried) + 1 < attempts:
                    failure = UpstreamError(f"worker {worker.name} answered {upstream.status}")
                    tried.append(worker.name)
                    continue
                return await _relay(http, upstream, worker, state)
            finally:
                upstream.release()
        finally:
            lease.release()
    assert failure is not None
    raise failure


async def by_load(http: web.Request) -> web.StreamResponse:
    state = http.app[STATE_KEY]
    raw = await http.read()
    model = _model_of(raw)
    return await forward(http, state, lambda tried: least_loaded(state, model, tried), True)


async def stored_response(http: web.Request) -> web.StreamResponse:
    state = http.app[STATE_KEY]
    tenant = state.tenant_of(http.raw_headers)
    holder = await state.holder_of(http.match_info["response_id"], tenant)

    def choose(tried: list[str]) -> Worker:
        if not holder.healthy:
            raise NoEligibleWorker(
                f"the worker that stored this response ({holder.name}) is not healthy"
            )
        return holder

    return await forward(http, state, choose, False)


ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("POST", "/v1/messages/count_tokens", by_load),
    ("POST", "/v1/embeddings", by_load),
    ("POST", "/tokenize", by_load),
    ("POST", "/detokenize", by_load),
    ("GET", "/v1/responses/{response_id}", stored_response),
    ("POST", "/v1/responses/{response_id}/cancel", stored_response),
)
