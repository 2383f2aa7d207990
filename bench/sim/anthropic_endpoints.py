"""vLLM's Anthropic Messages endpoints: the request converted (``router.apis.anthropic_chat``), run
on the chat path, and answered in Anthropic's shapes (``anthropic_api``)."""

from __future__ import annotations

from bench.sim import anthropic_api
from bench.sim.engine import Engine
from bench.sim.exchange import Exchange, Reply, Stream, error_reply, json_reply, read_json
from bench.sim.generation import finished, raise_injected_fault, submit
from bench.sim.openai_api import parse_request
from bench.sim.prompts import encode_prompt, num_tokens
from bench.sim.request_fields import ApiError, invalid, requested_model
from bench.sim.sse import stream_events
from router.apis.anthropic_chat import chat_request
from router.apis.invalid import InvalidBody


async def messages(engine: Engine, exchange: Exchange) -> Reply | Stream:
    """vLLM's ``POST /v1/messages``: the request run as the chat completion it converts
    to. A body that does not validate gets chat's error shape, as in vLLM; the rest
    (the model check, the context length, faults) Anthropic's."""
    try:
        chat = chat_request(await read_json(exchange))
    except ApiError as exc:
        return error_reply(exc)
    except InvalidBody as exc:
        return error_reply(invalid(exc))
    try:
        raise_injected_fault(engine)
        parsed = await parse_request(
            "chat",
            chat,
            engine.config.served_model_name,
            engine.max_model_len,
            engine.prompts,
            tool_calls=False,
        )
    except ApiError as exc:
        return json_reply(anthropic_api.error_body(exc), exc.status)
    rid = anthropic_api.message_id(exchange.request_id())
    sim = submit(engine, parsed, exchange)
    try:
        if parsed.stream:
            events = anthropic_api.MessageEvents(rid, parsed.model, engine.block_tokens)
            return await stream_events(exchange, events, sim, engine.faults)
        await finished(sim)
        return json_reply(anthropic_api.message_body(rid, parsed.model, sim, engine.block_tokens))
    finally:
        engine.abort(sim)


async def count_tokens(engine: Engine, exchange: Exchange) -> Reply:
    """vLLM's ``POST /v1/messages/count_tokens``: the templated prompt's tokens (the
    generation prompt included), with no context-length limit."""
    try:
        chat = chat_request(await read_json(exchange), count_only=True)
    except ApiError as exc:
        return error_reply(exc)
    except InvalidBody as exc:
        return error_reply(invalid(exc))
    try:
        requested_model(chat, engine.config.served_model_name)
        prompt = await encode_prompt(engine.prompts, "chat", chat)
    except ApiError as exc:
        return json_reply(anthropic_api.error_body(exc), exc.status)
    return json_reply(anthropic_api.count_tokens_body(num_tokens(prompt)))
