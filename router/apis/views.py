"""A Responses or Messages request seen as the chat request the engine runs it as: what
the router keys and routes it by (``router.apis.request``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from router.apis.anthropic_chat import chat_request
from router.apis.invalid import InvalidBody
from router.apis.responses_chat import chat_messages, input_messages
from router.errors import BadRequest


@dataclass(frozen=True, slots=True)
class ResponsesLink:
    """A Responses request as a link of a stored conversation: the engine renders a
    request continuing it (``previous_response_id``) as its instructions, its stored
    messages without their system messages, its reply, then the new input
    (``router.apis.responses_chat``). That prompt extends this one's only where both
    have the same instructions (and the same tools and template options, which the
    template renders first) and this one's input holds no system message."""

    # Instructions, tools and template kwargs, as a digest: a link extends the one it
    # continues only where these are the same (router.index.stored_chain).
    context: int
    input_from: int  # the messages from here on are the input; before it, instructions
    # A later request can continue it as an extension: the engine stores it, and drops
    # nothing of it but the leading instructions.
    extendable: bool


@dataclass(frozen=True, slots=True)
class ChatView:
    fields: Mapping[str, Any]  # a chat completion body: model, messages, tools, …
    # The API's own session-like field, if set: its parameter's name and its value.
    session: tuple[str, str] | None = None
    continues: str | None = None  # a stored response this request continues
    link: ResponsesLink | None = None  # a Responses request's place in its conversation


def _checked(convert: Callable[[], ChatView]) -> ChatView:
    try:
        return convert()
    except InvalidBody as exc:
        where = f"'{exc.field}': " if exc.field and exc.field not in exc.message else ""
        raise BadRequest(where + exc.message, param=exc.field or None) from None
    except RecursionError:  # json.dumps of a tool's input nested deeper than it goes
        raise BadRequest("the request is nested too deeply") from None


def messages_chat(body: Mapping[str, Any]) -> ChatView:
    """An Anthropic Messages body. ``metadata.user_id`` is the session where the client
    names none (Claude Code puts its session id there)."""

    def convert() -> ChatView:
        metadata = body.get("metadata")
        user = metadata.get("user_id") if isinstance(metadata, dict) else None
        session = ("metadata.user_id", user) if isinstance(user, str) and user else None
        return ChatView(chat_request(body), session)

    return _checked(convert)


def responses_chat(body: Mapping[str, Any]) -> ChatView:
    """An OpenAI Responses body: ``instructions`` and ``input`` as messages, function
    tools in chat's form. ``prompt_cache_key`` is the session where the client names
    none (Codex sends its conversation id there)."""

    def convert() -> ChatView:
        if "input" not in body:
            raise InvalidBody("input", "'input' is required")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidBody("model", "'model' must be a non-empty string")
        instructions = _optional_str(body, "instructions")
        previous = _optional_str(body, "previous_response_id")
        new_input = input_messages(body["input"])
        messages = chat_messages(instructions, new_input)
        fields: dict[str, Any] = {"model": model, "messages": messages}
        tools = _function_tools(body.get("tools"))
        if tools:
            fields["tools"] = tools
        for name in ("cache_salt", "chat_template_kwargs"):
            if body.get(name) is not None:
                fields[name] = body[name]
        cache_key = _optional_str(body, "prompt_cache_key")
        link = _link(body, instructions, tools, new_input, len(messages) - len(new_input))
        session = ("prompt_cache_key", cache_key) if cache_key else None
        return ChatView(fields, session, previous or None, link)

    return _checked(convert)


def _link(
    body: Mapping[str, Any],
    instructions: str | None,
    tools: list[dict[str, Any]],
    new_input: Sequence[Mapping[str, Any]],
    input_from: int,
) -> ResponsesLink | None:
    """None where the context cannot be written down (nested past what orjson writes):
    then the request is neither keyed as a continuation nor continued as one."""
    shared = [instructions or None, tools, body.get("chat_template_kwargs")]
    try:
        context = xxhash.xxh3_64_intdigest(orjson.dumps(shared, option=orjson.OPT_SORT_KEYS))
    except orjson.JSONEncodeError:
        return None
    stored = body.get("store") is not False
    extendable = stored and all(m.get("role") != "system" for m in new_input)
    return ResponsesLink(context, input_from, extendable)


def _optional_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidBody(name, f"'{name}' must be a string")
    return value


def _function_tools(tools: Any) -> list[dict[str, Any]]:
    """Responses' function tools (``{"type": "function", "name", …}``) as chat's
    (``{"type": "function", "function": {"name", …}}``), as vLLM hands them to the
    chat template; other tool types do not reach the template."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidBody("tools", "'tools' must be an array")
    return [
        {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
        for tool in tools
        if isinstance(tool, dict) and tool.get("type") == "function"
    ]
