"""The simulated engine's HTTP API (vLLM's OpenAI API and SGLang's extras), apart from
the server that carries it.

An endpoint takes the engine and an :class:`Exchange` (the request body, and the way to
start a streamed reply) and returns a whole :class:`Reply` or the :class:`Stream` it
wrote. Two front-ends carry the same endpoints: ``bench/sim/server.py`` on aiohttp (the
engine inside another program's event loop: tests, in-process benchmarks) and
``bench/sim/http1.py`` on httptools (the engine's own process, where a seventh of the
CPU a request cost went to aiohttp). ``tests/sim/test_sim_http.py`` checks that the two send
the same bytes.

A request the engine drops (a simulated restart) raises ``ConnectionResetError``: the
front-end answers 500 if nothing was sent yet, else ends the connection mid-stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable, Mapping

from bench.sim import checkpoint as checkpoints
from bench.sim.anthropic_endpoints import count_tokens, messages
from bench.sim.engine import Engine
from bench.sim.exchange import (
    Exchange,
    Reply,
    Stream,
    error_reply,
    json_reply,
    query_bool,
    read_json,
)
from bench.sim.generation import finished, raise_injected_fault, submit
from bench.sim.openai_api import (
    VLLM_VERSION,
    ParsedRequest,
    full_response,
    models_body,
    new_id,
    parse_request,
    usage,
)
from bench.sim.request import SimRequest
from bench.sim.request_fields import ApiError
from bench.sim.responses_endpoints import cancel_response, create_response, get_response
from bench.sim.sse import stream_completion
from bench.sim.tokenize import detokenize, render, tokenize
from router.wire.kinds import PromptKind

Endpoint = Callable[[Engine, Exchange], Awaitable[Reply | Stream]]

SGLANG_VERSION = "0.5.3"


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


# -- completions ------------------------------------------------------------------------


async def chat_completions(engine: Engine, exchange: Exchange) -> Reply | Stream:
    return await _completion(engine, exchange, "chat")


async def completions(engine: Engine, exchange: Exchange) -> Reply | Stream:
    return await _completion(engine, exchange, "completion")


async def _completion(engine: Engine, exchange: Exchange, kind: PromptKind) -> Reply | Stream:
    try:
        raise_injected_fault(engine)
        parsed = await parse_request(
            kind,
            await read_json(exchange),
            engine.config.served_model_name,
            engine.max_model_len,
            engine.prompts,
            tool_parser=engine.config.tool_call_parser is not None,
        )
    except ApiError as exc:
        return error_reply(exc)
    sim = submit(engine, parsed, exchange)
    try:
        if parsed.stream:
            if parsed.parses_tools:
                engine.metrics.record_tool_parser(True, called=parsed.calls is not None)
            return await stream_completion(
                exchange, parsed, sim, engine.faults, engine.block_tokens
            )
        reply = await _respond_whole(parsed, sim, engine.block_tokens)
        if parsed.parses_tools:
            # A whole reply cut before its call was complete is text (``full_response``).
            called = parsed.calls is not None and sim.finish_reason != "length"
            engine.metrics.record_tool_parser(False, called=called)
        return reply
    finally:
        engine.abort(sim)  # no-op when it finished; frees blocks when the client left


async def _respond_whole(parsed: ParsedRequest, sim: SimRequest, block_tokens: int) -> Reply:
    await finished(sim)
    body = full_response(
        parsed.kind,
        new_id(parsed.kind),
        parsed.model,
        int(time.time()),
        sim.output_text(),
        sim.finish_reason or "length",
        usage(
            parsed.kind,
            False,
            sim.prompt_tokens,
            sim.output_tokens,
            sim.cached_tokens,
            sim.cache_written_tokens(block_tokens),
        ),
        parsed.fingerprint,
        parsed.calls,
        parsed.calls_named,
    )
    return json_reply(body)


# -- tokenizer endpoints ----------------------------------------------------------------


async def tokenize_handler(engine: Engine, exchange: Exchange) -> Reply:
    """vLLM's ``POST /tokenize``, chat or completion body (``bench/sim/tokenize.py``)."""
    try:
        body = await read_json(exchange)
        tokens = await tokenize(
            body, engine.config.served_model_name, engine.max_model_len, engine.prompts
        )
        return json_reply(tokens)
    except ApiError as exc:
        return error_reply(exc)


async def detokenize_handler(engine: Engine, exchange: Exchange) -> Reply:
    try:
        body = await read_json(exchange)
        return json_reply(await detokenize(body, engine.config.served_model_name, engine.prompts))
    except ApiError as exc:
        return error_reply(exc)


async def render_chat(engine: Engine, exchange: Exchange) -> Reply:
    return await _render(engine, exchange, "chat")


async def render_completion(engine: Engine, exchange: Exchange) -> Reply:
    return await _render(engine, exchange, "completion")


async def _render(engine: Engine, exchange: Exchange, kind: PromptKind) -> Reply:
    """vLLM's render endpoints: the request validated and tokenized exactly as its
    completion would be, answered as a ``GenerateRequest`` (for completions a list of
    one), with nothing submitted to the engine."""
    try:
        body = await read_json(exchange)
        parsed = await parse_request(
            kind,
            body,
            engine.config.served_model_name,
            engine.max_model_len,
            engine.prompts,
            tool_parser=engine.config.tool_call_parser is not None,
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
        changes = await read_json(exchange)
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


async def _checkpoint_path(exchange: Exchange) -> str:
    body = await read_json(exchange)
    path = body.get("path") if isinstance(body, dict) else None
    if not isinstance(path, str) or not path:
        raise ApiError(400, 'expected a JSON object {"path": "<file>"}')
    return path


async def checkpoint(engine: Engine, exchange: Exchange) -> Reply:
    """Write the engine's cache to ``{"path": ...}`` (``bench/sim/checkpoint.py``);
    answers the path, the bytes and the blocks written."""
    try:
        path = await _checkpoint_path(exchange)
        taken = checkpoints.take(engine)
        size = await asyncio.to_thread(checkpoints.write, path, taken)
    except ApiError as exc:
        return error_reply(exc)
    except checkpoints.CheckpointError as exc:
        return error_reply(ApiError(400, str(exc)))
    return json_reply(checkpoints.summary(path, taken, size))


async def restore_checkpoint(engine: Engine, exchange: Exchange) -> Reply:
    """Replace the cache with the checkpoint at ``{"path": ...}``, as a new process
    restored from it (a new start time, KV events anew). 409 while requests run or for
    another engine's checkpoint, 400 for a file that is not a checkpoint."""
    try:
        path = await _checkpoint_path(exchange)
        restored = await asyncio.to_thread(checkpoints.read, path)
        await checkpoints.restore(engine, restored)
    except ApiError as exc:
        return error_reply(exc)
    except (checkpoints.CheckpointMismatch, checkpoints.EngineBusy) as exc:
        return error_reply(ApiError(409, str(exc)))
    except checkpoints.CheckpointError as exc:
        return error_reply(ApiError(400, str(exc)))
    answer = checkpoints.summary(path, restored, 0)
    del answer["bytes"]
    answer["process_start_time_seconds"] = engine.start_time
    return json_reply(answer)


async def reset_prefix_cache(engine: Engine, exchange: Exchange) -> Reply:
    """vLLM's ``POST /reset_prefix_cache`` (served by vLLM with
    ``VLLM_SERVER_DEV_MODE=1``): the cache forgotten, announced as ``AllBlocksCleared``;
    refused (logged, still 200, as vLLM does not check) while requests hold blocks,
    unless ``?reset_running_requests=true`` preempts them first."""
    try:
        reset_running = query_bool(exchange, "reset_running_requests")
        query_bool(exchange, "reset_external")  # no connector: nothing external to reset
    except ApiError as exc:
        return error_reply(exc)
    engine.reset_prefix_cache(reset_running)
    return Reply(200)


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
    ("POST", "/sim/checkpoint"): checkpoint,
    ("POST", "/sim/restore"): restore_checkpoint,
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
