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
from collections.abc import Callable

import orjson

from router.edge.routes import Call, Handler, Request
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
from router.state import RouterState
from router.upstream import ConnectFailed, UpstreamResponse
from router.workers import Lease, Worker

log = logging.getLogger(__name__)


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


def _headers_for_engine(request: Request, state: RouterState) -> bytes:
    lines = [
        b"%s: %s\r\n" % (name, value)
        for name, value in request.headers
        if name.lower() in FORWARDED_HEADERS or name.lower() == REQUEST_ID_HEADER.lower()
    ]
    return b"".join(lines) + state.upstream_auth


async def _open(state: RouterState, worker: Worker, request: Request) -> UpstreamResponse:
    headers = _headers_for_engine(request, state)
    try:
        return await state.upstream.send(
            worker.origin, request.target, headers, request.body, request.method.encode()
        )
    except TimeoutError as exc:
        raise UpstreamTimeout(f"worker {worker.name} timed out") from exc
    except ConnectionError as exc:
        if isinstance(exc, ConnectFailed):
            state.mark_unreachable(worker)
        raise UpstreamError(f"worker {worker.name} unreachable: {exc}") from exc


async def _relay(call: Call, upstream: UpstreamResponse, worker: Worker) -> None:
    """The worker's answer, streamed on as it comes."""
    headers = passed_on(upstream.headers)
    request_id = call.request.header(REQUEST_ID_HEADER.lower())
    if request_id is not None:  # the client's own, as the engine was sent it
        headers.append((REQUEST_ID_HEADER, request_id))
    if call.state.config.worker_header:
        headers.append((WORKER_HEADER, worker.name.encode()))
    reply = call.reply
    await reply.start(upstream.status, headers)
    try:
        while chunk := await upstream.read_chunk():
            await reply.write(chunk)
    except UPSTREAM_ERRORS as exc:
        log.warning("worker %s failed while relaying %s: %r", worker.name, call.request.path, exc)
        raise ConnectionResetError("the worker failed mid-answer") from exc
    await reply.end()


async def forward(call: Call, choose: Callable[[list[str]], Worker], retry: bool) -> None:
    state = call.state
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
                upstream = await _open(state, worker, call.request)
            except (UpstreamError, UpstreamTimeout) as exc:
                failure = exc
                tried.append(worker.name)
                continue
            try:
                if upstream.status >= 500 and retry and len(tried) + 1 < attempts:
                    failure = UpstreamError(f"worker {worker.name} answered {upstream.status}")
                    tried.append(worker.name)
                    continue
                await _relay(call, upstream, worker)
                return
            finally:
                upstream.release()
        finally:
            lease.release()
    assert failure is not None
    raise failure


async def by_load(call: Call) -> None:
    state = call.state
    model = _model_of(call.request.body)
    await forward(call, lambda tried: least_loaded(state, model, tried), True)


async def stored_response(call: Call) -> None:
    state = call.state
    tenant = state.tenant_of(call.request.headers)
    holder = await state.holder_of(call.request.params["response_id"], tenant)

    def choose(tried: list[str]) -> Worker:
        if not holder.healthy:
            raise NoEligibleWorker(
                f"the worker that stored this response ({holder.name}) is not healthy"
            )
        return holder

    await forward(call, choose, False)


ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("POST", "/v1/messages/count_tokens", by_load),
    ("POST", "/v1/embeddings", by_load),
    ("POST", "/tokenize", by_load),
    ("POST", "/detokenize", by_load),
    ("GET", "/v1/responses/{response_id}", stored_response),
    ("POST", "/v1/responses/{response_id}/cancel", stored_response),
)
