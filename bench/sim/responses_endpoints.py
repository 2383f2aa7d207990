"""vLLM's Responses endpoints: the request rendered to chat messages
(``responses_request``), run on the chat path, answered and streamed in the Responses
shapes (``responses_api``), and kept in the engine's store (``responses_store``)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

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
from bench.sim.openai_api import parse_request
from bench.sim.request_fields import ApiError, requested_model
from bench.sim.responses_api import ResponseEvents, ResponseHead, new_item_id, not_found
from bench.sim.responses_api import response_id as new_response_id
from bench.sim.responses_request import (
    ResponsesRequest,
    chat_body,
    check_max_output_tokens,
    parse,
    sampling,
)
from bench.sim.responses_store import StoredResponse
from bench.sim.sse import stream_events
from router.apis.responses_chat import chat_messages

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
        request = parse(await read_json(exchange))
        if request.background:
            if not store_on:
                raise ApiError(400, _NO_STORE_BACKGROUND, param="background")
            raise ApiError(501, "background responses are not simulated", "NotImplementedError")
        raise_injected_fault(engine)
        model = requested_model(request.body, engine.config.served_model_name)
        messages = _response_messages(engine, request)
        check_max_output_tokens(request, engine.max_model_len)
        chat = chat_body(request, model, messages)
        parsed = await parse_request(
            "chat",
            chat,
            engine.config.served_model_name,
            engine.max_model_len,
            engine.prompts,
            tool_calls=False,
        )
    except ApiError as exc:
        return error_reply(exc)
    # vLLM clamps max_output_tokens to what the context leaves.
    max_tokens = min(request.max_output_tokens or parsed.max_tokens, parsed.max_tokens)
    exact = parsed.ignore_eos or parsed.min_tokens >= max_tokens
    parsed = dataclasses.replace(parsed, max_tokens=max_tokens, exact_length=exact)
    head = ResponseHead(
        request,
        new_response_id(request.request_id),
        model,
        int(time.time()),
        max_tokens,
        sampling(request, engine.config.tokenizer),
    )
    sim = submit(engine, parsed, exchange)
    try:
        if request.stream:
            events = ResponseEvents(head, engine.block_tokens)
            result: Reply | Stream = await stream_events(exchange, events, sim, engine.faults)
            final = events.final
        else:
            await finished(sim)
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
        return chat_messages(request.instructions, request.input_messages)
    previous = engine.responses.get(previous_id) if engine.config.responses_store else None
    if previous is None:
        raise not_found(previous_id)
    return chat_messages(
        request.instructions,
        request.input_messages,
        previous.messages,
        previous.response["output"],
    )


async def get_response(engine: Engine, exchange: Exchange) -> Reply:
    """vLLM's ``GET /v1/responses/{id}``: the stored object as the POST answered it.
    Replaying a stream (``?stream=true``) needs a background stream, never stored here:
    vLLM's 400 for it."""
    rid = exchange.path_param()
    try:
        stream = query_bool(exchange, "stream")
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
