"""The request path: parse -> hash -> choose -> forward -> stream back -> record.

Failures before the first byte reaches the client (connection refused, timeout, an
upstream 5xx, a stream that ends before its first chunk) are retried on another worker,
up to ``upstream.max_attempts`` workers; after the first byte, a broken upstream ends the
stream with an error event. The client's response is prepared only when the upstream's
first body chunk is in hand, so a worker that fails after its headers is still retried.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

import orjson
from aiohttp import web
from multidict import CIMultiDict

from policies.base import Outcome
from router.capture import ReplyCapture
from router.clock import monotonic
from router.config import UpstreamConfig
from router.errors import (
    NoEligibleWorker,
    PayloadTooLarge,
    RouterError,
    UpstreamError,
    UpstreamTimeout,
)
from router.lifecycle import RequestLifecycle
from router.parse import Kind, parse_request
from router.prefix import CHAT_REPLY_HEADER, COMPLETION_REPLY_HEADER, ChainExtender
from router.routing import Dispatch, EngineUsage
from router.state import STATE_KEY, RouterState
from router.upstream import ConnectFailed, UpstreamResponse

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# Request headers passed on to the engine (lower case); everything else stays here.
FORWARDED_HEADERS = frozenset(
    {
        "content-type",
        "accept",
        "user-agent",
        "traceparent",
        "tracestate",
        "baggage",  # W3C trace context: vLLM's --otlp-traces-endpoint
    }
)
WORKER_HEADER = "X-Kvrouter-Worker"
REQUEST_ID_HEADER = "X-Request-Id"
# Non-streaming responses are read whole before they are sent on; this bounds them.
MAX_WHOLE_RESPONSE_BYTES = 64 * 1024 * 1024
UPSTREAM_ERRORS = (TimeoutError, ConnectionError)
CHAT_PATH, COMPLETION_PATH = b"/v1/chat/completions", b"/v1/completions"
# What the client reads when its worker fails mid-stream (the details go to the log; a
# worker's address is not the client's business).
MID_STREAM_ERROR_EVENT = (
    b"data: "
    + orjson.dumps(UpstreamError("the worker serving this request failed mid-stream").body())
    + b"\n\n"
)


@dataclass(frozen=True, slots=True)
class _Fallback:
    """An upstream error response to pass on if no other worker can be tried."""

    status: int
    body: bytes
    content_type: str


class _Retry(Exception):
    """The attempt failed before the client saw a byte; another worker may be tried."""

    def __init__(self, error: RouterError, fallback: _Fallback | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.fallback = fallback

    @property
    def outcome(self) -> Outcome:
        return "timeout" if isinstance(self.error, UpstreamTimeout) else "upstream_error"


def _forward_headers(
    headers: Mapping[str, str], request_id: str, upstream: UpstreamConfig
) -> list[tuple[str, str]]:
    """The client's headers an engine is meant to see: an allow-list, so its credentials
    (Authorization, Cookie) stay here and the body's Content-Encoding, which aiohttp
    undid on reading, is not claimed for the plain body sent on."""
    out = [(k, v) for k, v in headers.items() if k.lower() in FORWARDED_HEADERS]
    out.append((REQUEST_ID_HEADER, request_id))
    out.extend(upstream.auth_headers.items())
    return out


def _response_headers(
    http: web.Request, upstream: UpstreamResponse, worker: str, request_id: str
) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in upstream.headers:
        key = name.decode("latin-1")
        if key.lower() not in HOP_BY_HOP:
            out.add(key, value.decode("latin-1"))
    if http.app[STATE_KEY].config.worker_header:
        out[WORKER_HEADER] = worker
    out[REQUEST_ID_HEADER] = request_id
    return out


async def handle_chat(http: web.Request) -> web.StreamResponse:
    return await _handle(http, "chat")


async def handle_completions(http: web.Request) -> web.StreamResponse:
    return await _handle(http, "completion")


async def _read_body(http: web.Request, limit: int) -> bytes:
    if http.content_length is not None and http.content_length > limit:
        raise PayloadTooLarge(f"request body is larger than {limit} bytes")
    try:
        return await http.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body is larger than {limit} bytes") from None


async def _handle(http: web.Request, kind: Kind) -> web.StreamResponse:
    state = http.app[STATE_KEY]
    config = state.config
    arrived = monotonic()
    raw = await _read_body(http, config.max_body_bytes)
    request = parse_request(
        kind,
        raw,
        http.headers.get(config.session_header),
        config.session_body_fields,
        config.prefix.block_bytes,
        config.limits,
    )
    request_id = http.headers.get(REQUEST_ID_HEADER) or secrets.token_hex(16)
    lifecycle = RequestLifecycle(state.router, state.admission, request, request_id, arrived)
    await lifecycle.admit()
    failure: _Retry | None = None
    for _ in range(config.upstream.max_attempts):
        if failure is not None and monotonic() - arrived > config.upstream.retry_deadline_s:
            break  # too late to try again
        try:
            dispatch = lifecycle.dispatch()
        except NoEligibleWorker:
            if failure is None:
                raise
            break
        try:
            return await _attempt(http, state, lifecycle, dispatch)
        except _Retry as retry:
            failure = retry
            log.warning(
                "request %s failed on %s before the first byte: %s",
                request_id,
                dispatch.worker.name,
                retry.error.message,
            )
    assert failure is not None
    lifecycle.gave_up(failure.outcome)
    if failure.fallback is not None:
        fb = failure.fallback
        return web.Response(status=fb.status, body=fb.body, content_type=fb.content_type)
    raise failure.error


async def _open(
    state: RouterState, dispatch: Dispatch, http: web.Request, request_id: str
) -> UpstreamResponse:
    path = CHAT_PATH if dispatch.request.kind == "chat" else COMPLETION_PATH
    try:
        return await state.upstream.post(
            dispatch.worker.origin,
            path,
            _forward_headers(http.headers, request_id, state.config.upstream),
            dispatch.request.body,
        )
    except TimeoutError as exc:
        raise _Retry(UpstreamTimeout(f"worker {dispatch.worker.name} timed out")) from exc
    except ConnectionError as exc:
        # Only a refused or failed new connection says the worker is down; a pooled
        # connection the engine closed while idle says nothing about its health.
        if isinstance(exc, ConnectFailed):
            state.mark_unreachable(dispatch.worker)
        raise _Retry(UpstreamError(f"worker {dispatch.worker.name} unreachable: {exc}")) from exc


async def _attempt(
    http: web.Request,
    state: RouterState,
    lifecycle: RequestLifecycle,
    dispatch: Dispatch,
) -> web.StreamResponse:
    request, request_id = dispatch.request, dispatch.route.request_id
    header = CHAT_REPLY_HEADER if request.kind == "chat" else COMPLETION_REPLY_HEADER
    extender = (
        ChainExtender(request.key, state.config.prefix.block_bytes, header)
        if request.record_reply and state.config.prefix.record_replies
        else None
    )
    capture = ReplyCapture(extender, request.kind == "chat")
    outcome: Outcome = "upstream_error"
    sent = False
    # A reply that arrives whole says nothing of when the prefill ended; past the time
    # it should have taken, the prompt stops counting as queued prefill on the worker.
    prefilled = (
        None
        if request.stream
        else asyncio.get_running_loop().call_later(
            dispatch.expected_prefill_s(), dispatch.lease.prefill_done
        )
    )
    # Cleared once the first chunk is in hand (_relay_stream); a whole reply has none,
    # but is given up on too if its worker fails a health probe before its headers.
    first_byte = asyncio.timeout(
        state.config.upstream.first_byte_timeout_s if request.stream else None
    )
    unanswered = dispatch.worker.unanswered
    try:
        async with first_byte:
            unanswered.add(first_byte)
            upstream = await _open(state, dispatch, http, request_id)
            if not request.stream:
                unanswered.discard(first_byte)  # a whole reply's headers are its answer
            try:
                if upstream.status >= 500:
                    body = await _read_whole(dispatch, upstream)
                    raise _Retry(
                        UpstreamError(f"worker {dispatch.worker.name} answered {upstream.status}"),
                        _Fallback(upstream.status, body, upstream.content_type),
                    )
                if request.stream and upstream.status == 200:
                    response, outcome = await _relay_stream(
                        http, dispatch, upstream, capture, request_id, first_byte
                    )
                else:
                    response, outcome = await _relay_whole(
                        http, dispatch, upstream, capture, request_id
                    )
                sent = True
                return response
            finally:
                upstream.release()
    except _Retry as retry:
        outcome = retry.outcome
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        outcome = "client_disconnect"
        sent = True  # the worker may have started; its blocks are recorded
        raise
    except TimeoutError as exc:
        outcome = "timeout"
        if first_byte.expired():  # the worker said nothing at all: another may
            why = (
                "failed its health probe before answering"
                if not dispatch.worker.healthy
                else f"sent nothing in {state.config.upstream.first_byte_timeout_s:g} s"
            )
            raise _Retry(UpstreamTimeout(f"worker {dispatch.worker.name} {why}")) from exc
        raise
    finally:
        unanswered.discard(first_byte)
        if prefilled is not None:
            prefilled.cancel()
        if sent:
            _finished(lifecycle, dispatch, capture, outcome)
        else:
            lifecycle.failed(dispatch, outcome)


def _finished(
    lifecycle: RequestLifecycle, dispatch: Dispatch, capture: ReplyCapture, outcome: Outcome
) -> None:
    prompt, cached = capture.prompt_tokens, capture.cached_tokens
    usage = (
        EngineUsage(prompt, cached, capture.completion_tokens)
        if prompt is not None and cached is not None
        else None
    )
    reply = capture.reply_hashes() if outcome == "success" else []
    lifecycle.finished(dispatch, outcome, reply, usage, prompt)


def _failed(dispatch: Dispatch, what: str, exc: BaseException) -> _Retry:
    """A retryable failure; a timeout answers 504 if no other worker can be tried."""
    error = UpstreamTimeout if isinstance(exc, TimeoutError) else UpstreamError
    return _Retry(error(f"worker {dispatch.worker.name} {what}: {exc!r}"))


async def _read_whole(dispatch: Dispatch, upstream: UpstreamResponse) -> bytes:
    body = bytearray()
    try:
        while chunk := await upstream.read_chunk():
            body += chunk
            if len(body) > MAX_WHOLE_RESPONSE_BYTES:
                raise UpstreamError(
                    f"worker {dispatch.worker.name} answered more than "
                    f"{MAX_WHOLE_RESPONSE_BYTES} bytes"
                )
    except UPSTREAM_ERRORS as exc:
        raise _failed(dispatch, "failed", exc) from exc
    return bytes(body)


async def _first_chunk(dispatch: Dispatch, upstream: UpstreamResponse) -> bytes:
    try:
        chunk = await upstream.read_chunk()
    except UPSTREAM_ERRORS as exc:
        raise _failed(dispatch, "failed before its first byte", exc) from exc
    if not chunk:
        raise _Retry(
            UpstreamError(f"worker {dispatch.worker.name} closed the stream before its first byte")
        )
    return chunk


async def _relay_stream(
    http: web.Request,
    dispatch: Dispatch,
    upstream: UpstreamResponse,
    capture: ReplyCapture,
    request_id: str,
    first_byte: asyncio.Timeout,
) -> tuple[web.StreamResponse, Outcome]:
    first = await _first_chunk(dispatch, upstream)
    first_byte.reschedule(None)  # from here on only read_timeout_s bounds the stream
    dispatch.worker.unanswered.discard(first_byte)
    dispatch.first_byte()
    response = web.StreamResponse(
        status=upstream.status,
        headers=_response_headers(http, upstream, dispatch.worker.name, request_id),
    )
    await response.prepare(http)
    events = WholeEvents()
    capture.feed_stream(first)
    if whole := events.cut(first):
        await response.write(whole)
    outcome: Outcome = "success"
    while True:
        try:
            chunk = await upstream.read_chunk()
        except UPSTREAM_ERRORS as exc:
            outcome = "timeout" if isinstance(exc, TimeoutError) else "upstream_error"
            log.warning(
                "request %s: worker %s failed mid-stream: %r", request_id, dispatch.worker.name, exc
            )
            # The half event it sent is dropped: the client reads only whole events.
            await response.write(MID_STREAM_ERROR_EVENT)
            break
        if not chunk:
            if rest := events.rest():
                await response.write(rest)
            break
        capture.feed_stream(chunk)
        if whole := events.cut(chunk):
            await response.write(whole)  # a client that went away raises here
    if capture.errored:
        outcome = "upstream_error"
    await response.write_eof()
    return response, outcome


# The most of an unfinished event the relay holds back (a worker that never ends one
# must not fill the router's memory).
MAX_HELD_EVENT_BYTES = 1024 * 1024


class WholeEvents:
    """Cuts a relayed SSE stream at event boundaries, so that a worker failing in the
    middle of an event never leaves the client half of one."""

    __slots__ = ("_partial",)

    def __init__(self) -> None:
        self._partial = b""

    def cut(self, chunk: bytes) -> bytes:
        """The whole events ``chunk`` completes; the rest is held for the next chunk."""
        data = self._partial + chunk if self._partial else chunk
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        if len(data) - end > MAX_HELD_EVENT_BYTES:
            end = len(data)  # no event is this long: pass it on rather than hold it all
        self._partial = data[end:]
        return data[:end] if self._partial else data

    def rest(self) -> bytes:
        """What the worker sent after its last whole event (it closed the stream there)."""
        rest, self._partial = self._partial, b""
        return rest


async def _relay_whole(
    http: web.Request,
    dispatch: Dispatch,
    upstream: UpstreamResponse,
    capture: ReplyCapture,
    request_id: str,
) -> tuple[web.StreamResponse, Outcome]:
    body = await _read_whole(dispatch, upstream)
    # No TTFT: the whole body arrived at once. A refusal (4xx) computed nothing.
    dispatch.first_byte(observe=False, computed=upstream.status < 400)
    if upstream.status == 200:
        capture.feed_whole(body)
    response = web.Response(
        status=upstream.status,
        body=body,
        headers=_response_headers(http, upstream, dispatch.worker.name, request_id),
    )
    return response, "success" if upstream.status < 400 else "rejected"
