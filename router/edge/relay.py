"""The request path: parse -> hash -> choose -> forward -> stream back -> record.

``serve`` is the handler of the four keyed routes (``router.app.relay_for``): it gets the
decoded body and the raw headers, and answers through a ``Reply``.

Failures before the first byte reaches the client (connection refused, timeout, an
upstream 5xx, a stream that ends before its first chunk) are retried on another worker,
up to ``upstream.max_attempts`` workers; after the first byte, a broken upstream ends the
stream with an error event. The client's response is prepared only when the upstream's
first body chunk is in hand, so a worker that fails after its headers is still retried.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from policies.base import Outcome
from router.apis.capture import ReplyCapture
from router.apis.request import (
    ClientRequest,
    RequestBody,
    keyed_blind,
    keyed_by_text,
    keyed_continuing,
    read_request,
)
from router.apis.table import APIS
from router.clock import monotonic
from router.edge.reply import Reply
from router.edge.routes import Call
from router.edge.settlement import Settlement, reply_chain
from router.errors import (
    UpstreamError,
    UpstreamTimeout,
)
from router.fleet.upstream import ConnectFailed, UpstreamResponse
from router.fleet.workers import Worker
from router.index.stored_chain import StoredChain
from router.observability.metrics import ContinuationKeyed
from router.routing.attempts import AttemptFailed, Fallback, run_attempts
from router.routing.dispatch import Dispatch
from router.routing.lifecycle import QueueTerms, RequestLifecycle
from router.state import RouterState
from router.wire import headers
from router.wire.kinds import Kind

log = logging.getLogger(__name__)

NOT_PASSED_ON = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"server",  # the engine's software and version are not the client's business
        # The router's own: an engine's would be a second copy, and could be a false one.
        headers.WORKER_HEADER.lower().encode(),
        headers.REQUEST_ID_HEADER.lower().encode(),
    }
)
# An engine's headers passed on to a client, at most: vLLM sends four. Past it a client
# may refuse the whole answer (Python's http.client does past 100 header lines).
MAX_PASSED_ON = 64
# Request headers passed on to the engine (lower case); everything else stays here.
FORWARDED_HEADERS = frozenset(
    {
        b"content-type",
        b"accept",
        b"user-agent",
        b"traceparent",
        b"tracestate",
        b"baggage",  # W3C trace context: vLLM's --otlp-traces-endpoint
    }
)
WORKER_HEADER = headers.WORKER_HEADER.encode()
REQUEST_ID_HEADER = headers.REQUEST_ID_HEADER.encode()
_REQUEST_ID = REQUEST_ID_HEADER.lower()
_PRIORITY = headers.PRIORITY_HEADER.lower().encode()
Headers = Sequence[tuple[bytes, bytes]]
# Non-streaming responses are read whole before they are sent on; this bounds them.
MAX_WHOLE_RESPONSE_BYTES = 64 * 1024 * 1024
UPSTREAM_ERRORS = (TimeoutError, ConnectionError)


@dataclass(frozen=True, slots=True)
class _ClientHeaders:
    """What the proxy reads of the client's headers, in one pass over them."""

    forwarded: bytes  # the header lines an engine is meant to see
    request_id: str | None
    sessions: dict[bytes, bytes]  # the session headers sent: lower-case name -> value
    priority: bytes | None  # the class the client asked for (PRIORITY_HEADER)


def _read_headers(raw: Headers, session_headers: frozenset[bytes]) -> _ClientHeaders:
    """An allow-list, so the client's credentials (Authorization, Cookie) stay here and a
    Content-Encoding its server undid on reading is not claimed for the plain body sent
    on. ``session_headers``: the names of the headers a session key is read from, lower
    case; the first of each name counts."""
    lines: list[bytes] = []
    request_id: str | None = None
    priority: bytes | None = None
    sessions: dict[bytes, bytes] = {}
    for name, value in raw:
        key = name.lower()
        if key in FORWARDED_HEADERS:
            lines.append(b"%s: %s\r\n" % (name, value))
        elif key == _REQUEST_ID:
            request_id = request_id or value.decode("latin-1") or None
        elif key == _PRIORITY:
            priority = priority or value
        elif key in session_headers:
            sessions.setdefault(key, value)
    return _ClientHeaders(b"".join(lines), request_id, sessions, priority)


async def serve(kind: Kind, call: Call) -> None:
    """Serves one client request of ``kind`` (the route's handler, with ``kind`` bound:
    ``router.app.routes_for``); a ``RouterError`` raised here is the client's answer
    (its server renders it)."""
    state, reply = call.state, call.reply
    raw, raw_headers = call.request.body, call.request.headers
    config = state.config
    arrived = monotonic()
    sources = state.session_sources
    headers = _read_headers(raw_headers, sources.header_names)
    tenant = state.tenant_of(raw_headers)  # sessions are a client key's own
    body = read_request(kind, raw, headers.sessions, sources, config.limits, tenant)
    state.metrics.counter(state.metrics.session_keys, body.session_source).inc()
    holder = None
    block_bytes = config.prefix.key_block_bytes
    if body.continues is not None:  # only the worker that stored it can continue it
        continuation = await state.continuation_of(body.continues, tenant)
        holder = continuation.holder
        request = await continued(state, body, continuation.chain, block_bytes)
    elif state.tokens is not None:
        request = await state.tokens.key(body, block_bytes)
    else:
        request = keyed_by_text(body, block_bytes)
    request_id = headers.request_id or secrets.token_hex(16)
    terms = QueueTerms(
        state.queue.priority_of(tenant, headers.priority), tenant, len(raw), kind == "messages"
    )
    lifecycle = RequestLifecycle(
        state.router, state.queue, request, request_id, arrived, holder, state.shared_path, terms
    )
    try:
        await lifecycle.admit()
        client = _Client(
            reply, headers.forwarded + state.upstream_auth, request_id, config.worker_header, tenant
        )
        attempt = functools.partial(_attempt, client, state, lifecycle)
        try:
            await run_attempts(lifecycle, state.retry, attempt, request_id)
        except AttemptFailed as last:
            await answer_failure(reply, last)
    finally:
        lifecycle.end()


async def continued(
    state: RouterState, body: RequestBody, chain: StoredChain | None, block_bytes: int
) -> ClientRequest:
    """A request continuing a stored response, keyed as the conversation it continues
    (``chain``) followed by its input, in the chain's own terms: text, or the model's
    tokens. Blind where that cannot be had: the chain unknown, of another context, seed
    or block size, or its input not rendered as the engine renders it."""
    request = None
    link = body.link
    if chain is not None and link is not None and chain.fits(body.seed, link.context, block_bytes):
        if chain.keyed_by == "text" or not chain.whole:
            request = keyed_continuing(body, chain, block_bytes)
        elif state.tokens is not None:
            request = await state.tokens.continued(body, chain, block_bytes)
    keyed: ContinuationKeyed = "blind"
    if request is None:
        request = keyed_blind(body)
    else:
        keyed = "cut" if request.cut else "chain"
    metrics = state.metrics
    metrics.counter(metrics.continuations, keyed).inc()
    return request


async def answer_failure(reply: Reply, last: AttemptFailed) -> None:
    """No worker served the request: the last one's own 5xx is passed on, if it sent one;
    else its error is raised for the connection to render."""
    if last.fallback is None:
        raise last.error from None
    fallback = last.fallback
    await reply.whole(fallback.status, ((b"Content-Type", fallback.content_type),), fallback.body)


def passed_on(engine_headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The engine's headers a client is meant to see (the first ``MAX_PASSED_ON``)."""
    out = [(k, v) for k, v in engine_headers if k.lower() not in NOT_PASSED_ON]
    return out[:MAX_PASSED_ON]


@dataclass(frozen=True, slots=True)
class _Client:
    reply: Reply
    forwarded: bytes  # header lines for the engine, the router's own credentials included
    request_id: str
    worker_header: bool  # the answer names its worker (X-Kvrouter-Worker)
    tenant: str | None  # whose a response it stores is (``router.auth.tenant``)

    @property
    def request_id_line(self) -> bytes:
        return b"%s: %s\r\n" % (REQUEST_ID_HEADER, self.request_id.encode("latin-1"))

    def response_headers(self, upstream: UpstreamResponse, worker: str) -> Headers:
        """The worker's headers the client is meant to see, and the router's own."""
        out = passed_on(upstream.headers)
        if self.worker_header:
            out.append((WORKER_HEADER, worker.encode()))
        out.append((REQUEST_ID_HEADER, self.request_id.encode("latin-1")))
        return out


async def send_to(
    state: RouterState,
    worker: Worker,
    target: bytes,
    headers: bytes,
    body: bytes,
    method: bytes = b"POST",
) -> UpstreamResponse:
    """The worker's answer, its head read; a failure to get it is ``AttemptFailed``."""
    try:
        return await state.upstream.send(worker.origin, target, headers, body, method)
    except TimeoutError as exc:
        raise AttemptFailed(UpstreamTimeout(f"worker {worker.name} timed out")) from exc
    except ConnectionError as exc:
        # Only a refused or failed new connection says the worker is down; a pooled
        # connection the engine closed while idle says nothing about its health.
        if isinstance(exc, ConnectFailed):
            state.mark_unreachable(worker)
        raise AttemptFailed(UpstreamError(f"worker {worker.name} unreachable: {exc}")) from exc


async def _attempt(
    client: _Client,
    state: RouterState,
    lifecycle: RequestLifecycle,
    dispatch: Dispatch,
) -> None:
    request = dispatch.request
    api = APIS[request.kind]
    capture = api.capture(reply_chain(state, dispatch, api.reply_header))
    outcome: Outcome = "upstream_error"
    sent = False
    # Cleared once the first chunk is in hand (_relay_stream); a whole reply has none,
    # but is given up on too if its worker fails a health probe before its headers.
    first_byte = asyncio.timeout(
        state.config.upstream.first_byte_timeout_s if request.stream else None
    )
    settlement = Settlement(state, lifecycle, dispatch, capture, client.tenant)
    try:
        async with first_byte, lifecycle.attempting(dispatch, first_byte):
            upstream = await send_to(
                state,
                dispatch.worker,
                APIS[request.kind].path,
                client.forwarded + client.request_id_line,
                request.body,
            )
            if not request.stream:
                lifecycle.answered(dispatch, first_byte)  # a whole reply's headers are it
            try:
                if upstream.status >= 500:
                    raise await server_error(dispatch.worker, upstream)
                if request.stream and upstream.status == 200:
                    outcome = await _relay_stream(
                        client, lifecycle, dispatch, upstream, capture, first_byte, settlement
                    )
                else:
                    outcome = await _relay_whole(
                        client, lifecycle, dispatch, upstream, capture, settlement
                    )
                sent = True
            finally:
                upstream.release()
    except AttemptFailed as failed:
        outcome = failed.outcome
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
            raise AttemptFailed(UpstreamTimeout(f"worker {dispatch.worker.name} {why}")) from exc
        raise
    finally:
        if sent:
            settlement.finish(outcome)
        else:
            settlement.fail(outcome)


def _failed(worker: Worker, what: str, exc: BaseException) -> AttemptFailed:
    """A retryable failure; a timeout answers 504 if no other worker can be tried."""
    error = UpstreamTimeout if isinstance(exc, TimeoutError) else UpstreamError
    return AttemptFailed(error(f"worker {worker.name} {what}: {exc!r}"))


async def read_whole(worker: Worker, upstream: UpstreamResponse) -> bytes:
    body = bytearray()
    try:
        while chunk := await upstream.read_chunk():
            body += chunk
            if len(body) > MAX_WHOLE_RESPONSE_BYTES:
                raise UpstreamError(
                    f"worker {worker.name} answered more than {MAX_WHOLE_RESPONSE_BYTES} bytes"
                )
    except UPSTREAM_ERRORS as exc:
        raise _failed(worker, "failed", exc) from exc
    return bytes(body)


async def server_error(worker: Worker, upstream: UpstreamResponse) -> AttemptFailed:
    """A worker's 5xx: another worker may be tried, and if none is, this is the answer."""
    body = await read_whole(worker, upstream)
    return AttemptFailed(
        UpstreamError(f"worker {worker.name} answered {upstream.status}"),
        Fallback(upstream.status, body, upstream.content_type.encode()),
    )


async def _first_chunk(dispatch: Dispatch, upstream: UpstreamResponse) -> bytes:
    try:
        chunk = await upstream.read_chunk()
    except UPSTREAM_ERRORS as exc:
        raise _failed(dispatch.worker, "failed before its first byte", exc) from exc
    if not chunk:
        raise AttemptFailed(
            UpstreamError(f"worker {dispatch.worker.name} closed the stream before its first byte")
        )
    return chunk


async def _relay_stream(
    client: _Client,
    lifecycle: RequestLifecycle,
    dispatch: Dispatch,
    upstream: UpstreamResponse,
    capture: ReplyCapture,
    first_byte: asyncio.Timeout,
    settlement: Settlement,
) -> Outcome:
    """Passes the stream on whole event by whole event. Once the engine's terminal event
    is in hand the attempt is settled before that event goes on (``Settlement.complete``);
    the body's end may follow in a later chunk, by when the client may have closed."""
    first = await _first_chunk(dispatch, upstream)
    first_byte.reschedule(None)  # from here on only read_timeout_s bounds the stream
    lifecycle.answered(dispatch, first_byte)
    lifecycle.first_byte(dispatch)
    reply, request_id = client.reply, client.request_id
    await reply.start(upstream.status, client.response_headers(upstream, dispatch.worker.name))
    events = WholeEvents()
    chunk = first
    client_left = False
    while True:
        capture.feed_stream(chunk)
        whole = events.cut(chunk)
        if (capture.ended or upstream.ended) and settlement.outcome is None:
            if reply.client_gone():  # it left before the end was passed on
                raise ConnectionResetError("the client went away")
            await settlement.complete("upstream_error" if capture.errored else "success")
        try:
            if upstream.ended:  # what came last came with the end: one write
                if not client_left:
                    await reply.end(whole + events.rest())
                break
            if whole and not client_left:
                await reply.write(whole)  # a client that went away raises here
        except ConnectionResetError:
            if settlement.outcome is None:
                raise
            client_left = True  # it has the terminal event: read the engine's end still
        try:
            chunk = await upstream.read_chunk()
        except UPSTREAM_ERRORS as exc:
            if settlement.outcome is not None:
                break  # everything was sent; only the body's end went missing
            log.warning(
                "request %s: worker %s failed mid-stream: %r", request_id, dispatch.worker.name, exc
            )
            # The half event it sent is dropped: the client reads only whole events.
            await reply.end(APIS[dispatch.request.kind].mid_stream_error)
            return "timeout" if isinstance(exc, TimeoutError) else "upstream_error"
    assert settlement.outcome is not None
    return settlement.outcome


# The most of an unfinished event the relay holds back (a worker that never ends one
# must not fill the router's memory).
MAX_HELD_EVENT_BYTES = 1024 * 1024


class WholeEvents:
    """Cuts a relayed SSE stream at event boundaries, so that a worker failing in the
    middle of an event never leaves the client half of one. Each byte is scanned once
    and held bytes are joined once, when their event ends: an event sent in many small
    pieces costs what its length does."""

    __slots__ = ("_held", "_held_bytes", "_tail")

    def __init__(self) -> None:
        self._held: list[bytes] = []  # an unfinished event, as it came
        self._held_bytes = 0
        self._tail = b""  # its last bytes: a boundary can straddle two chunks

    def cut(self, chunk: bytes) -> bytes:
        """The whole events ``chunk`` completes; the rest is held for the next chunk."""
        tail = self._tail
        window = tail + chunk
        lf, crlf = window.rfind(b"\n\n"), window.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0) - len(tail)
        if end <= 0:
            self._hold(chunk, window)
            if self._held_bytes > MAX_HELD_EVENT_BYTES:
                return self.rest()  # no event is this long: pass it on rather than hold it
            return b""
        whole = b"".join((*self._held, chunk[:end])) if self._held else chunk[:end]
        self._held.clear()
        self._held_bytes, self._tail = 0, b""
        rest = chunk[end:]
        if len(rest) > MAX_HELD_EVENT_BYTES:
            return whole + rest
        if rest:
            self._hold(rest, rest)
        return whole

    def _hold(self, piece: bytes, ending: bytes) -> None:
        self._held.append(piece)
        self._held_bytes += len(piece)
        self._tail = ending[-3:]

    def rest(self) -> bytes:
        """What the worker sent after its last whole event (it closed the stream there)."""
        rest = b"".join(self._held)
        self._held.clear()
        self._held_bytes, self._tail = 0, b""
        return rest


async def _relay_whole(
    client: _Client,
    lifecycle: RequestLifecycle,
    dispatch: Dispatch,
    upstream: UpstreamResponse,
    capture: ReplyCapture,
    settlement: Settlement,
) -> Outcome:
    body = await read_whole(dispatch.worker, upstream)
    # No TTFT: the whole body arrived at once. A refusal (4xx) computed nothing.
    lifecycle.first_byte(dispatch, observe=False, computed=upstream.status < 400)
    outcome: Outcome = "success" if upstream.status < 400 else "rejected"
    if upstream.status == 200:
        capture.feed_whole(body)
    await settlement.complete(outcome)
    await client.reply.whole(
        upstream.status, client.response_headers(upstream, dispatch.worker.name), body
    )
    return outcome
