"""The simulated engine's HTTP API (vLLM's OpenAI API and SGLang's extras), apart from
the server that carries it.

An endpoint takes the engine and an :class:`Exchange` (the request body, and the way to
start a streamed reply) and returns a whole :class:`Reply` or the :class:`Stream` it
wrote. Two front-ends carry the same endpoints: ``bench/sim/server.py`` on aiohttp (the
engine inside another program's event loop: tests, in-process benchmarks) and
``bench/sim/http1.py`` on httptools (the engine's own process, where a seventh of the
CPU a request cost went to aiohttp). ``tests/test_sim_http.py`` checks that the two send
the same bytes.

A request the engine drops (a simulated restart) raises ``ConnectionResetError``: the
front-end answers 500 if nothing was sent yet, else ends the connection mid-stream.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from bench.sim import anthropic_api
from bench.sim.anthropic_request import chat_request
from bench.sim.engine import Engine
from bench.sim.openai_api import (
    ParsedRequest,
    full_response,
    models_body,
    new_id,
    parse_request,
    usage,
)
from bench.sim.prompts import Kind, encode_prompt, num_tokens
from bench.sim.request import SimRequest
from bench.sim.request_fields import ApiError, requested_model
from bench.sim.responses_api import ResponseEvents, ResponseHead, new_item_id, not_found
from bench.sim.responses_api import response_id as new_response_id
from bench.sim.responses_request import ResponsesRequest, chat_body, chat_messages, parse
from bench.sim.responses_store import StoredResponse
from bench.sim.sse import stream_completion, stream_events
from bench.sim.tokenize import detokenize, render, tokenize

VLLM_VERSION = "0.11.0"
SGLANG_VERSION = "0.5.3"
MAX_BODY_BYTES = 64 * 1024 * 1024
JSON = "application/json"
Headers = Sequence[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole response. ``content_type`` None: the body (if any) goes without one."""

    status: int = 200
    body: bytes = b""
    content_type: str | None = None


class Stream(Protocol):
    """A streamed response whose head is sent: the body in pieces, then the end."""

    async def write(self, data: bytes) -> None: ...

    async def end(self, data: bytes) -> None:
        """Send ``data`` and end the body, in one write."""

    def ready(self) -> bool:
        """Whether ``write_nowait`` may be called: the front-end can write without
        awaiting, and the client's socket buffer has room."""

    def write_nowait(self, data: bytes) -> None:
        """``write`` without awaiting; only when ``ready()``."""


class Exchange(Protocol):
    """One request as an endpoint sees it."""

    def query(self, name: str) -> str | None:
        """The last value of query parameter ``name``, if given."""

    def request_id(self) -> str | None:
        """The ``X-Request-Id`` header as sent (the first, if repeated), if any."""

    def path_param(self) -> str:
        """The path's one parameter (``param_routes``), decoded; "" on other routes."""

    async def read(self) -> bytes:
        """The request body; ``ApiError`` 413 past ``MAX_BODY_BYTES``."""

    async def stream(self, headers: Headers) -> Stream:
        """Send a 200 head with ``headers`` and return the stream for the body."""


Endpoint = Callable[[Engine, Exchange], Awaitable[Reply | Stream]]


def json_reply(body: Any, status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(body), JSON)


def error_reply(exc: ApiError) -> Reply:
    return json_reply(exc.body(), exc.status)


def too_large() -> ApiError:
    return ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes")


def unauthorized() -> Reply:
    """The 401 of ``api_key_check`` (as aiohttp's ``json_response`` encoded it)."""
    return Reply(401, b'{"error": "Unauthorized"}', "application/json; charset=utf-8")


def api_key_check(api_key: str) -> Callable[[str, str, str], bool]:
    """vLLM's ``AuthenticationMiddleware`` (``--api-key``) as ``allowed(method, path,
    authorization)``: a request to a path under /v1, other than OPTIONS, needs
    ``Authorization: Bearer <key>`` (the scheme in any case); /health, /metrics and the
    rest are open. The digests are compared, so the time does not tell the key."""
    wanted = hashlib.sha256(api_key.encode()).digest()

    def allowed(method: str, path: str, authorization: str) -> bool:
        if method == "OPTIONS" or not path.startswith("/v1"):
            return True
        scheme, _, token = authorization.partition(" ")
        given = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(given, wanted)

    return allowed


async def _read_json(exchange: Exchange) -> Any:
    try:
        return orjson.loads(await exchange.read())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc


# -- completions ------------------------------------------------------------------------


async def chat_completions(engine: Engine, exchange: Exchange) -> Reply | Stream:
    return await _completion(engine, exchange, "chat")


async def completions(engine: Engine, exchange: Exchange) -> Reply | Stream:
    return await _completion(engine, exchange, "completion")


async def _completion(engine: Engine, exchange: Exchange, kind: Kind) -> Reply | Stream:
    faults = engine.faults.state
    try:
        if faults.fail_requests:
            raise ApiError(faults.fail_status, "simulated engine failure (fault injected)")
        parsed = await parse_request(
            kind,
            await _read_json(exchange),
            engine.config.served_model_name,
            engine.max_model_len,
            engine.prompts,
        )
    except ApiError as exc:
        return error_reply(exc)
    sim = _submit(engine, parsed, exchange)
    try:
        if parsed.stream:
            return await stream_completion(exchange, parsed, sim)
        return await _respond_whole(parsed, sim)
    finally:
        engine.abort(sim)  # no-op when it finished; frees blocks when the client left


def _submit(engine: Engine, parsed: ParsedRequest, exchange: Exchange) -> SimRequest:
    return engine.submit(
        parsed.prompt,
        parsed.max_tokens,
        parsed.exact_length,
        parsed.seed,
        parsed.cache_salt,
        exchange.request_id(),
    )


async def _finished(sim: SimRequest) -> SimRequest:
    while not sim.finished:
        await sim.next_update()
    if sim.dropped:
        raise ConnectionResetError("engine restarted")
    return sim


async def _respond_whole(parsed: ParsedRequest, sim: SimRequest) -> Reply:
    await _finished(sim)
    body = full_response(
        parsed.kind,
        new_id(parsed.kind),
        parsed.model,
        int(time.time()),
        sim.output_text(),
        sim.finish_reason or "length",
        usage(sim.prompt_tokens, sim.output_tokens, sim.cached_tokens),
    )
    return json_reply(body)


# -- Anthropic Messages (bench/sim/anthropic_request.py, bench/sim/anthropic_api.py) ------


async def messages(engine: Engine, exchange: Exchange) -> Reply | Stream:
    """vLLM's ``POST /v1/messages``: the request run as the chat completion it converts
    to. A body that does not validate gets chat's error shape, as in vLLM; the rest
    (the model check, the context length, faults) Anthropic's."""
    try:
        chat = chat_request(await _read_json(exchange))
    except ApiError as exc:
        return error_reply(exc)
    try:
        faults = engine.faults.state
        if faults.fail_requests:
            raise ApiError(faults.fail_status, "simulated engine failure (fault injected)")
        parsed = await parse_request(
            "chat", chat, engine.config.served_model_name, engine.max_model_len, engine.prompts
        )
    except ApiError as exc:
        return json_reply(anthropic_api.error_body(exc), exc.status)
    rid = anthropic_api.message_id(exchange.request_id())
    sim = _submit(engine, parsed, exchange)
    try:
        if parsed.stream:
            events = anthropic_api.MessageEvents(rid, parsed.model, engine.block_tokens)
            return await stream_events(exchange, events, sim)
        await _finished(sim)
        return json_reply(anthropic_api.message_body(rid, parsed.model, sim, engine.block_tokens))
    finally:
        engine.abort(sim)


async def count_tokens(engine: Engine, exchange: Exchange) -> Reply:
    """vLLM's ``POST /v1/messages/count_tokens``: the templated prompt's tokens (the
    generation prompt included), with no context-length limit."""
    try:
        chat = chat_request(await _read_json(exchange), count_only=True)
    except ApiError as exc:
        return error_reply(exc)
    try:
        requested_model(chat, engine.config.served_model_name)
        prompt = await encode_prompt(engine.prompts, "chat", chat)
    except ApiError as exc:
        return json_reply(anthropic_api.error_body(exc), exc.status)
    return json_reply(anthropic_api.count_tokens_body(num_tokens(prompt)))


# -- OpenAI Responses (bench/sim/responses_request.py, responses_api.py, responses_store.py)

_NO_STORE_BACKGROUND = (
    "This vLLM engine does not support `store=True` and therefore does not support the "
    "background mode. To enable these features, set the environment variable "
    "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server."
)


async def create_response(engine: Engine, exchange: Exchange) -> Reply | Stream:
    """vLLM's ``POST /v1/responses``: the request rendered to chat messages (after the
    stored conversation of ``previous_response_id``) and run as that chat completion;
    kept in the engine's store when the store is on and the request did not say
    ``store: false``."""
    store_on = engine.config.responses_store
    try:
        request = parse(await _read_json(exchange))
        if request.background:
            if not store_on:
                raise ApiError(400, _NO_STORE_BACKGROUND, param="background")
            raise ApiError(501, "background responses are not simulated", "NotImplementedError")
        faults = engine.faults.state
        if faults.fail_requests:
            raise ApiError(faults.fail_status, "simulated engine failure (fault injected)")
        model = requested_model(request.body, engine.config.served_model_name)
        messages = _response_messages(engine, request)
        chat = chat_body(request, model, messages)
        parsed = await parse_request(
            "chat", chat, engine.config.served_model_name, engine.max_model_len, engine.prompts
        )
    except ApiError as exc:
        return error_reply(exc)
    # vLLM clamps max_output_tokens to what the context leaves (no 400 for asking more).
    max_tokens = min(request.max_output_tokens or parsed.max_tokens, parsed.max_tokens)
    exact = parsed.ignore_eos or parsed.min_tokens >= max_tokens
    parsed = dataclasses.replace(parsed, max_tokens=max_tokens, exact_length=exact)
    head = ResponseHead(
        request, new_response_id(request.request_id), model, int(time.time()), max_tokens
    )
    sim = _submit(engine, parsed, exchange)
    try:
        if request.stream:
            events = ResponseEvents(head, engine.block_tokens)
            result: Reply | Stream = await stream_events(exchange, events, sim)
            final = events.final
        else:
            await _finished(sim)
            final = head.final(sim, new_item_id(), engine.block_tokens)
            result = json_reply(final)
    finally:
        engine.abort(sim)
    if store_on and request.store and final is not None:
        engine.responses.put(head.rid, StoredResponse(final, messages))
    return result


def _response_messages(engine: Engine, request: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of ``request``; a 404 for a ``previous_response_id`` the store
    does not hold (every one, with the store off)."""
    previous_id = request.previous_response_id
    if previous_id is None:
        return chat_messages(request)
    previous = engine.responses.get(previous_id) if engine.config.responses_store else None
    if previous is None:
        raise not_found(previous_id)
    return chat_messages(request, previous.messages, previous.response["output"])


async def get_response(engine: Engine, exchange: Exchange) -> Reply:
    """vLLM's ``GET /v1/responses/{id}``: the stored object as the POST answered it.
    Replaying a stream (``?stream=true``) needs a background stream, never stored here:
    vLLM's 400 for it."""
    rid = exchange.path_param()
    try:
        stream = _query_bool(exchange, "stream")
        stored = engine.responses.get(rid) if engine.config.responses_store else None
        if stored is None:
            raise not_found(rid)
        if stream:
            raise ApiError(400, "Unknown response_id", param="response_id")
    except ApiError as exc:
        return error_reply(exc)
    return json_reply(stored.response)


async def cancel_response(engine: Engine, exchange: Exchange) -> Reply:
    """vLLM's ``POST /v1/responses/{id}/cancel``: only a queued or running background
    response can be cancelled; everything stored here has finished, so a known id is
    vLLM's 400 and an unknown one its 404."""
    rid = exchange.path_param()
    stored = engine.responses.get(rid) if engine.config.responses_store else None
    if stored is None:
        return error_reply(not_found(rid))
    if stored.response["status"] not in ("queued", "in_progress"):
        message = "Cannot cancel a synchronous response."
        return error_reply(ApiError(400, message, "invalid_request_error", "response_id"))
    # Unreachable while background responses are not simulated (nothing is stored queued).
    stored.response["status"] = "cancelled"
    return json_reply(stored.response)


# -- tokenizer endpoints ----------------------------------------------------------------


async def tokenize_handler(engine: Engine, exchange: Exchange) -> Reply:
    """vLLM's ``POST /tokenize``, chat or completion body (``bench/sim/tokenize.py``)."""
    try:
        body = await _read_json(exchange)
        tokens = await tokenize(
            body, engine.config.served_model_name, engine.max_model_len, engine.prompts
        )
        return json_reply(tokens)
    except ApiError as exc:
        return error_reply(exc)


async def detokenize_handler(engine: Engine, exchange: Exchange) -> Reply:
    try:
        body = await _read_json(exchange)
        return json_reply(await detokenize(body, engine.config.served_model_name, engine.prompts))
    except ApiError as exc:
        return error_reply(exc)


async def render_chat(engine: Engine, exchange: Exchange) -> Reply:
    return await _render(engine, exchange, "chat")


async def render_completion(engine: Engine, exchange: Exchange) -> Reply:
    return await _render(engine, exchange, "completion")


async def _render(engine: Engine, exchange: Exchange, kind: Kind) -> Reply:
    """vLLM's render endpoints: the request validated and tokenized exactly as its
    completion would be, answered as a ``GenerateRequest`` (for completions a list of
    one), with nothing submitted to the engine."""
    try:
        body = await _read_json(exchange)
        parsed = await parse_request(
            kind, body, engine.config.served_model_name, engine.max_model_len, engine.prompts
        )
    except ApiError as exc:
        return error_reply(exc)
    rendered = render(kind, parsed, body.get("model"))
    return json_reply(rendered if kind == "chat" else [rendered])


# -- probes -----------------------------------------------------------------------------


async def list_models(engine: Engine, exchange: Exchange) -> Reply:
    owner = "vllm" if engine.config.flavor == "vllm" else "sglang"
    return json_reply(models_body(engine.config.served_model_name, engine.max_model_len, owner))


async def health(engine: Engine, exchange: Exchange) -> Reply:
    if engine.faults.state.stall:
        await engine.faults.wait_unstalled()
    return Reply(503 if engine.faults.state.fail_health else 200)


async def health_generate(engine: Engine, exchange: Exchange) -> Reply:
    """SGLang's deep health check: run a one-token generation through the engine."""
    sim = engine.submit(b"ping", 1, True)
    try:
        while not sim.finished:
            await sim.next_update()
    finally:
        engine.abort(sim)
    return Reply(200 if not sim.dropped else 503)


async def metrics(engine: Engine, exchange: Exchange) -> Reply:
    if engine.faults.state.fail_metrics:
        return Reply(503)
    engine.record_gauges()
    body, content_type = engine.metrics.render()
    return Reply(200, body, content_type)


async def version(engine: Engine, exchange: Exchange) -> Reply:
    flavor = engine.config.flavor
    return json_reply({"version": VLLM_VERSION if flavor == "vllm" else SGLANG_VERSION})


async def model_info(engine: Engine, exchange: Exchange) -> Reply:
    name = engine.config.served_model_name
    return json_reply({"model_path": name, "tokenizer_path": name, "is_generation": True})


async def server_info(engine: Engine, exchange: Exchange) -> Reply:
    config = engine.config
    return json_reply(
        {
            "model_path": config.served_model_name,
            "served_model_name": config.served_model_name,
            "tp_size": config.tensor_parallel_size,
            "page_size": config.block_tokens,
            "chunked_prefill_size": config.max_num_batched_tokens,
            "max_running_requests": config.max_num_seqs,
            "context_length": engine.max_model_len,
            "max_total_num_tokens": engine.num_blocks * engine.block_tokens,
            "mem_fraction_static": config.gpu_memory_utilization,
            "version": SGLANG_VERSION,
            "internal_states": [{"last_gen_throughput": 0.0}],
        }
    )


# -- the simulator's own controls --------------------------------------------------------


async def get_faults(engine: Engine, exchange: Exchange) -> Reply:
    return json_reply(engine.faults.as_dict())


async def set_faults(engine: Engine, exchange: Exchange) -> Reply:
    try:
        changes = await _read_json(exchange)
        if not isinstance(changes, dict):
            raise ApiError(400, "expected a JSON object of faults")
        engine.faults.update(changes)
    except ApiError as exc:
        return error_reply(exc)
    except ValueError as exc:
        return error_reply(ApiError(400, str(exc)))
    return json_reply(engine.faults.as_dict())


async def get_requests(engine: Engine, exchange: Exchange) -> Reply:
    """The engine's last requests and their cached prefixes (``bench/sim/request_log.py``)."""
    return json_reply(engine.requests.as_dict())


async def restart(engine: Engine, exchange: Exchange) -> Reply:
    """Simulate a process restart: in-flight requests dropped, cache empty, counters reset,
    KV events from a new publisher."""
    dropped = await engine.restart()
    return json_reply(
        {"dropped_requests": len(dropped), "process_start_time_seconds": engine.start_time}
    )


async def reset_prefix_cache(engine: Engine, exchange: Exchange) -> Reply:
    """vLLM's ``POST /reset_prefix_cache`` (served by vLLM with
    ``VLLM_SERVER_DEV_MODE=1``): the cache forgotten, announced as ``AllBlocksCleared``;
    refused (logged, still 200, as vLLM does not check) while requests hold blocks,
    unless ``?reset_running_requests=true`` preempts them first."""
    try:
        reset_running = _query_bool(exchange, "reset_running_requests")
        _query_bool(exchange, "reset_external")  # no connector: nothing external to reset
    except ApiError as exc:
        return error_reply(exc)
    engine.reset_prefix_cache(reset_running)
    return Reply(200)


_TRUE = ("1", "true", "t", "yes", "y", "on")
_FALSE = ("0", "false", "f", "no", "n", "off")


def _query_bool(exchange: Exchange, name: str) -> bool:
    """A boolean query parameter as FastAPI reads one (default false)."""
    value = exchange.query(name)
    if value is None or value.lower() in _FALSE:
        return False
    if value.lower() in _TRUE:
        return True
    raise ApiError(400, f"'{name}' must be a boolean", param=name)


_COMMON: dict[tuple[str, str], Endpoint] = {
    ("POST", "/v1/chat/completions"): chat_completions,
    ("POST", "/v1/completions"): completions,
    ("GET", "/v1/models"): list_models,
    ("GET", "/health"): health,
    ("GET", "/metrics"): metrics,
    ("GET", "/version"): version,
    ("GET", "/sim/faults"): get_faults,
    ("POST", "/sim/faults"): set_faults,
    ("POST", "/sim/restart"): restart,
    ("GET", "/sim/requests"): get_requests,
}
_FLAVORED: dict[str, dict[tuple[str, str], Endpoint]] = {
    "vllm": {
        ("POST", "/tokenize"): tokenize_handler,
        ("POST", "/detokenize"): detokenize_handler,
        ("POST", "/v1/chat/completions/render"): render_chat,
        ("POST", "/v1/completions/render"): render_completion,
        ("POST", "/reset_prefix_cache"): reset_prefix_cache,
        ("POST", "/v1/messages"): messages,
        ("POST", "/v1/messages/count_tokens"): count_tokens,
        ("POST", "/v1/responses"): create_response,
    },
    "sglang": {
        ("GET", "/model_info"): model_info,
        ("GET", "/get_model_info"): model_info,
        ("GET", "/server_info"): server_info,
        ("GET", "/get_server_info"): server_info,
        ("GET", "/health_generate"): health_generate,
    },
}


# Routes with one path parameter, written as aiohttp writes them (a parameter is one
# non-empty segment); ``match_param`` matches them for the httptools front-end.
_PARAM_ROUTES: dict[str, dict[tuple[str, str], Endpoint]] = {
    "vllm": {
        ("GET", "/v1/responses/{response_id}"): get_response,
        ("POST", "/v1/responses/{response_id}/cancel"): cancel_response,
    },
    "sglang": {},
}


def param_routes(flavor: str) -> Mapping[tuple[str, str], Endpoint]:
    """(method, path template) to endpoint, for the paths with a parameter."""
    return _PARAM_ROUTES[flavor]


def match_param(template: str, path: str) -> str | None:
    """The parameter of ``path`` if it matches ``template`` (one ``{name}``), else None."""
    prefix, _, rest = template.partition("{")
    suffix = rest.partition("}")[2]
    if len(path) <= len(prefix) + len(suffix):
        return None
    if not (path.startswith(prefix) and path.endswith(suffix)):
        return None
    value = path[len(prefix) : len(path) - len(suffix)]
    return value if "/" not in value else None


def routes(flavor: str) -> Mapping[tuple[str, str], Endpoint]:
    """(method, path) to endpoint for an engine of ``flavor``. A GET route answers HEAD
    too (the front-ends' business: the body is left out)."""
    return {**_COMMON, **_FLAVORED[flavor]}
