"""The simulated engine's HTTP server: vLLM's OpenAI API (and SGLang's extras) on aiohttp."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import web

from bench.sim.config import EngineConfig
from bench.sim.engine import Engine, running_engine
from bench.sim.openai_api import (
    ApiError,
    ChunkEvents,
    Kind,
    ParsedRequest,
    full_response,
    models_body,
    new_id,
    parse_request,
    sse_event,
    stream_chunk,
    usage,
    usage_chunk,
)
from bench.sim.request import SimRequest
from bench.sim.tokenize import detokenize, render, tokenize

ENGINE_KEY = web.AppKey("engine", Engine)
CONFIG_KEY = web.AppKey("config", EngineConfig)
VLLM_VERSION = "0.11.0"
SGLANG_VERSION = "0.5.3"
MAX_BODY_BYTES = 64 * 1024 * 1024


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _error(exc: ApiError) -> web.Response:
    return _json(exc.body(), exc.status)


async def _read_json(request: web.Request) -> Any:
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "completion")


async def _completion(http: web.Request, kind: Kind) -> web.StreamResponse:
    engine = http.app[ENGINE_KEY]
    faults = engine.faults.state
    try:
        if faults.fail_requests:
            raise ApiError(faults.fail_status, "simulated engine failure (fault injected)")
        parsed = parse_request(
            kind, await _read_json(http), engine.config.served_model_name, engine.max_model_len
        )
    except ApiError as exc:
        return _error(exc)
    sim = engine.submit(
        parsed.prompt, parsed.max_tokens, parsed.exact_length, parsed.seed, parsed.cache_salt
    )
    try:
        if parsed.stream:
            return await _stream(http, parsed, sim)
        return await _respond_whole(parsed, sim)
    finally:
        engine.abort(sim)  # no-op when it finished; frees blocks when the client left


async def _next_update(sim: SimRequest) -> None:
    await sim.updated.wait()
    sim.updated.clear()


def _dropped(sim: SimRequest) -> bool:
    """The engine lost the request (simulated restart): end the connection abruptly."""
    return sim.finished and sim.finish_reason == "abort"


async def _respond_whole(parsed: ParsedRequest, sim: SimRequest) -> web.StreamResponse:
    while not sim.finished:
        await _next_update(sim)
    if _dropped(sim):
        raise ConnectionResetError("engine restarted")
    body = full_response(
        parsed.kind,
        new_id(parsed.kind),
        parsed.model,
        int(time.time()),
        sim.output_text(),
        sim.finish_reason or "length",
        usage(sim.prompt_tokens, sim.output_tokens, sim.cached_tokens),
    )
    return _json(body)


async def _stream(http: web.Request, parsed: ParsedRequest, sim: SimRequest) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(http)
    rid, created, kind, model = new_id(parsed.kind), int(time.time()), parsed.kind, parsed.model
    chunks = ChunkEvents(kind, rid, model, created)
    # The events due at one wake-up go out in one write: the same bytes in fewer
    # syscalls (the role chunk with the first text, the last text with the usage).
    sent = 0
    while True:
        await _next_update(sim)
        if _dropped(sim):
            raise ConnectionResetError("engine restarted")
        events: list[bytes] = []
        if sent == 0 and kind == "chat":
            # As vLLM: the role chunk goes out with the first token, after the prefill.
            events.append(sse_event(stream_chunk(kind, rid, model, created, "", None, first=True)))
        if sim.output_tokens > sent:
            finish = sim.finish_reason if sim.finished else None
            events.append(chunks.text(sim.output_text(sent), finish))
            sent = sim.output_tokens
        if sim.finished:
            break
        if events:
            await response.write(b"".join(events))
    if parsed.include_usage:
        usage_body = usage(sim.prompt_tokens, sim.output_tokens, sim.cached_tokens)
        events.append(sse_event(usage_chunk(kind, rid, model, created, usage_body)))
    events.append(b"data: [DONE]\n\n")
    await response.write_eof(b"".join(events))
    return response


async def tokenize_handler(request: web.Request) -> web.Response:
    """vLLM's ``POST /tokenize``, chat or completion body (``bench/sim/tokenize.py``)."""
    engine = request.app[ENGINE_KEY]
    try:
        body = await _read_json(request)
        return _json(tokenize(body, engine.config.served_model_name, engine.max_model_len))
    except ApiError as exc:
        return _error(exc)


async def detokenize_handler(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    try:
        return _json(detokenize(await _read_json(request), engine.config.served_model_name))
    except ApiError as exc:
        return _error(exc)


async def render_chat(request: web.Request) -> web.Response:
    return await _render(request, "chat")


async def render_completion(request: web.Request) -> web.Response:
    return await _render(request, "completion")


async def _render(http: web.Request, kind: Kind) -> web.Response:
    """vLLM's render endpoints: the request validated and tokenized exactly as its
    completion would be, answered as a ``GenerateRequest`` (for completions a list of
    one), with nothing submitted to the engine."""
    engine = http.app[ENGINE_KEY]
    try:
        body = await _read_json(http)
        parsed = parse_request(kind, body, engine.config.served_model_name, engine.max_model_len)
    except ApiError as exc:
        return _error(exc)
    rendered = render(kind, parsed, body.get("model"))
    return _json(rendered if kind == "chat" else [rendered])


async def list_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    owner = "vllm" if engine.config.flavor == "vllm" else "sglang"
    return _json(models_body(engine.config.served_model_name, engine.max_model_len, owner))


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if engine.faults.state.stall:
        await engine.faults.wait_unstalled()
    if engine.faults.state.fail_health:
        return web.Response(status=503)
    return web.Response(status=200)


async def health_generate(request: web.Request) -> web.Response:
    """SGLang's deep health check: run a one-token generation through the engine."""
    engine = request.app[ENGINE_KEY]
    sim = engine.submit(b"ping", 1, True)
    try:
        while not sim.finished:
            await _next_update(sim)
    finally:
        engine.abort(sim)
    return web.Response(status=200 if not _dropped(sim) else 503)


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if engine.faults.state.fail_metrics:
        return web.Response(status=503)
    engine.record_gauges()
    body, content_type = engine.metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def version(request: web.Request) -> web.Response:
    flavor = request.app[ENGINE_KEY].config.flavor
    return _json({"version": VLLM_VERSION if flavor == "vllm" else SGLANG_VERSION})


async def model_info(request: web.Request) -> web.Response:
    name = request.app[ENGINE_KEY].config.served_model_name
    return _json({"model_path": name, "tokenizer_path": name, "is_generation": True})


async def server_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    config = engine.config
    return _json(
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


async def get_faults(request: web.Request) -> web.Response:
    return _json(request.app[ENGINE_KEY].faults.as_dict())


async def set_faults(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    try:
        changes = await _read_json(request)
        if not isinstance(changes, dict):
            raise ApiError(400, "expected a JSON object of faults")
        engine.faults.update(changes)
    except ApiError as exc:
        return _error(exc)
    except ValueError as exc:
        return _error(ApiError(400, str(exc)))
    return _json(engine.faults.as_dict())


async def restart(request: web.Request) -> web.Response:
    """Simulate a process restart: in-flight requests dropped, cache empty, counters reset."""
    engine = request.app[ENGINE_KEY]
    dropped = engine.restart()
    return _json(
        {"dropped_requests": len(dropped), "process_start_time_seconds": engine.start_time}
    )


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPRequestEntityTooLarge:
        return _error(ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes"))
    except web.HTTPException as exc:
        if exc.status >= 400:
            return _error(ApiError(exc.status, exc.reason))
        raise


def _api_key_check(api_key: str) -> Any:
    """vLLM's ``AuthenticationMiddleware`` (``--api-key``): a request to a path under /v1,
    other than OPTIONS, needs ``Authorization: Bearer <key>`` (the scheme in any case),
    else 401 ``{"error": "Unauthorized"}``; /health, /metrics and the rest are open."""
    wanted = hashlib.sha256(api_key.encode()).digest()

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method != "OPTIONS" and request.path.startswith("/v1"):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            given = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
            if scheme.lower() != "bearer" or not hmac.compare_digest(given, wanted):
                return web.json_response({"error": "Unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    return check


def create_app(config: EngineConfig) -> web.Application:
    """The engine's application; the engine loop runs for the app's lifetime."""
    middlewares = [_errors] if config.api_key is None else [_errors, _api_key_check(config.api_key)]
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app[CONFIG_KEY] = config

    async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
        async with running_engine(app[CONFIG_KEY]) as engine:
            app[ENGINE_KEY] = engine
            yield

    app.cleanup_ctx.append(engine_ctx)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_get("/sim/faults", get_faults)
    app.router.add_post("/sim/faults", set_faults)
    app.router.add_post("/sim/restart", restart)
    if config.flavor == "vllm":
        app.router.add_post("/tokenize", tokenize_handler)
        app.router.add_post("/detokenize", detokenize_handler)
        app.router.add_post("/v1/chat/completions/render", render_chat)
        app.router.add_post("/v1/completions/render", render_completion)
    if config.flavor == "sglang":
        app.router.add_get("/model_info", model_info)
        app.router.add_get("/get_model_info", model_info)
        app.router.add_get("/server_info", server_info)
        app.router.add_get("/get_server_info", server_info)
        app.router.add_get("/health_generate", health_generate)
    return app


async def serve(config: EngineConfig, host: str, port: int) -> None:
    """Run one engine until cancelled."""
    runner = web.AppRunner(create_app(config), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    try:
        await asyncio.Event().wait()
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()
