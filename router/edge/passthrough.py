"""The engine endpoints that are forwarded without prefix work: a worker chosen by load
(``count_tokens``, embeddings, ``/tokenize``, ``/detokenize``), or the one worker that
stored a response (``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``).

Nothing of these enters the index or the learning. Their attempts run in the same loop
as the keyed routes' (``router.routing.attempts``), through a ``PlainLifecycle``: the least
loaded of the same eligible workers (``Worker.load``), a lease that counts as load
while the request runs, the breaker told how it went. A worker that cannot be reached,
or answers 5xx, before anything reached the client is replaced by the next least
loaded, as ``upstream.max_attempts`` and ``retry_deadline_s`` allow; a stored response
has one worker, and its failure is the client's answer.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import orjson

from policies.base import Outcome
from router.edge.relay import (
    FORWARDED_HEADERS,
    REQUEST_ID_HEADER,
    UPSTREAM_ERRORS,
    WORKER_HEADER,
    answer_failure,
    passed_on,
    send_to,
    server_error,
)
from router.edge.routes import Call, Handler, Request
from router.fleet.upstream import UpstreamResponse
from router.fleet.workers import Lease, Worker
from router.routing.attempts import AttemptFailed, run_attempts
from router.routing.lifecycle import PlainLifecycle
from router.state import RouterState

log = logging.getLogger(__name__)


def _model_of(raw: bytes) -> str | None:
    """The body's ``model``, if it names one (the engine judges the rest)."""
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model else None


def _headers_for_engine(request: Request, state: RouterState) -> bytes:
    lines = [
        b"%s: %s\r\n" % (name, value)
        for name, value in request.headers
        if name.lower() in FORWARDED_HEADERS or name.lower() == REQUEST_ID_HEADER.lower()
    ]
    return b"".join(lines) + state.upstream_auth


class _WorkerFailedMidAnswer(Exception):
    pass


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
        raise _WorkerFailedMidAnswer from exc
    await reply.end()


async def _attempt(call: Call, lifecycle: PlainLifecycle, lease: Lease) -> None:
    worker, request = lease.worker, call.request
    outcome: Outcome = "upstream_error"
    sent = False  # the client has begun to get an answer
    try:
        headers = _headers_for_engine(request, call.state)
        # HEAD is sent on as GET (the reply leaves the body out): the upstream client
        # reads every answer's body by its length.
        method = b"GET" if request.method == "HEAD" else request.method.encode()
        upstream = await send_to(call.state, worker, request.target, headers, request.body, method)
        try:
            if upstream.status >= 500:
                raise await server_error(worker, upstream)
            sent = True
            await _relay(call, upstream, worker)
            outcome = "success" if upstream.status < 400 else "rejected"
        finally:
            upstream.release()
    except AttemptFailed as failed:
        outcome = failed.outcome
        raise
    except _WorkerFailedMidAnswer as exc:
        raise ConnectionResetError("the worker failed mid-answer") from exc
    except (asyncio.CancelledError, ConnectionResetError):
        outcome = "client_disconnect"
        raise
    finally:
        if sent:
            lifecycle.finished(lease, outcome)
        else:
            lifecycle.failed(lease, outcome)


async def forward(call: Call, lifecycle: PlainLifecycle) -> None:
    attempt = functools.partial(_attempt, call, lifecycle)
    request_id = call.request.header(REQUEST_ID_HEADER.lower()) or b"-"
    try:
        await run_attempts(lifecycle, call.state.retry, attempt, request_id.decode("latin-1"))
    except AttemptFailed as last:
        await answer_failure(call.reply, last)


async def by_load(call: Call) -> None:
    model = _model_of(call.request.body)
    await forward(call, PlainLifecycle(call.state.router, call.state.queue, model))


async def stored_response(call: Call) -> None:
    state = call.state
    tenant = state.tenant_of(call.request.headers)
    holder = await state.holder_of(call.request.params["response_id"], tenant)
    await forward(call, PlainLifecycle(state.router, state.queue, None, holder))


ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("POST", "/v1/messages/count_tokens", by_load),
    ("POST", "/v1/embeddings", by_load),
    ("POST", "/tokenize", by_load),
    ("POST", "/detokenize", by_load),
    ("GET", "/v1/responses/{response_id}", stored_response),
    ("POST", "/v1/responses/{response_id}/cancel", stored_response),
)
