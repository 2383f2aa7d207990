"""An OpenAI Responses request (``POST /v1/responses``) checked and turned into the chat
completion request the simulated engine runs, as vLLM 0.34 renders it
(``docs/engines/vllm-messages-responses.md`` §2.1-2.2; ``openai/responses/utils.py::
construct_input_messages``).

The chat messages are, in order:

1. ``instructions``, if any, as one system message;
2. with ``previous_response_id``: the stored messages that prompted that response (its
   own earlier turns included) without their system messages (instructions do not
   carry over), then one assistant message per content part of each of its ``message``
   output items;
3. the new ``input``: a string is one user message; a list's items are read one by one:
   a message with a role passes through (an assistant ``message`` item as the text of
   its first part), ``function_call`` becomes an assistant's tool call,
   ``function_call_output`` a ``tool`` message, ``reasoning`` an assistant's
   reasoning. Any other item type is a 400.

A body that does not fit the request model is a pydantic 400 (OpenAI's shape, ``type``
"Bad Request", ``param`` "body.<field>"). Not simulated: continuing a final assistant
message left ``in_progress`` (vLLM's ``continue_final_message``), tools (accepted,
without effect on the prompt), structured output, ``truncation: "auto"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.sim.anthropic_request import invalid
from bench.sim.request_fields import ApiError

# Request fields the chat request takes as they are (vLLM's sampling extras).
_PASSED_ON = ("temperature", "top_p", "top_k", "seed", "cache_salt", "ignore_eos", "stop")
# Content part types vLLM's chat renderer reads as text.
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A checked request; ``body`` is kept for the fields the response echoes."""

    body: Mapping[str, Any]
    instructions: str | None
    input_messages: list[dict[str, Any]]
    previous_response_id: str | None
    store: bool
    stream: bool
    background: bool
    max_output_tokens: int | None
    request_id: str | None


def _optional(body: Mapping[str, Any], name: str, kind: type, type_name: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise invalid(name, f"Input should be a valid {type_name}", f"{type_name}_type")
    return value


def parse(body: Any) -> ResponsesRequest:
    """``body`` checked as vLLM's ``ResponsesRequest`` model checks it."""
    if not isinstance(body, dict):
        raise invalid("", "Input should be a valid dictionary", "dict_type")
    if "input" not in body:
        raise invalid("input", "Field required", "missing")
    if body.get("prompt") is not None:
        raise ApiError(400, "prompt template is not supported", param="prompt")
    max_output_tokens = _optional(body, "max_output_tokens", int, "integer")
    if max_output_tokens is not None and max_output_tokens < 1:
        raise invalid("max_output_tokens", "max_output_tokens must be at least 1")
    store = _optional(body, "store", bool, "boolean")
    background = bool(_optional(body, "background", bool, "boolean"))
    if background and store is False:
        raise ApiError(400, "background can only be used when `store` is true", param="background")
    return ResponsesRequest(
        body=body,
        instructions=_optional(body, "instructions", str, "string"),
        input_messages=input_messages(body["input"]),
        previous_response_id=_optional(body, "previous_response_id", str, "string"),
        store=store is not False,
        stream=bool(_optional(body, "stream", bool, "boolean")),
        background=background,
        max_output_tokens=max_output_tokens,
        request_id=_optional(body, "request_id", str, "string"),
    )


def chat_messages(
    request: ResponsesRequest,
    history: Sequence[Mapping[str, Any]] = (),
    previous_output: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """The request's chat messages (steps 1-3 above); ``history`` and
    ``previous_output``: the stored messages and output of ``previous_response_id``."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    messages.extend(dict(m) for m in history if m.get("role") != "system")
    for item in previous_output:
        if item.get("type") == "message":
            messages.extend(
                {"role": "assistant", "content": part.get("text", "")}
                for part in item.get("content") or ()
            )
    messages.extend(request.input_messages)
    return messages


def chat_body(
    request: ResponsesRequest, model: str, messages: list[dict[str, Any]]
) -> dict[str, Any]:
    """The chat completion body that renders ``messages`` as vLLM renders the request
    (``max_output_tokens`` is applied by the caller: vLLM clamps it to the context)."""
    chat: dict[str, Any] = {"model": model, "messages": messages}
    chat.update({k: request.body[k] for k in _PASSED_ON if request.body.get(k) is not None})
    return chat


def input_messages(given: Any) -> list[dict[str, Any]]:
    """The new ``input`` as chat messages (step 3 above)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list):
        raise invalid("input", "Input should be a valid string or list")
    messages: list[dict[str, Any]] = []
    for item in given:
        if not isinstance(item, dict):
            raise invalid("input", "each input item must be an object")
        kind = item.get("type")
        if "role" in item and kind in (None, "message"):
            _add_message(messages, item)
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            _assistant(messages).setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
            )
        elif kind == "reasoning":
            _assistant(messages)["reasoning"] = _reasoning_text(item)
        else:
            raise ApiError(400, f"Unsupported input item type: {kind}", param="input")
    return messages


def _add_message(messages: list[dict[str, Any]], item: Mapping[str, Any]) -> None:
    role, content = item["role"], item.get("content")
    if role == "assistant" and isinstance(content, list):
        # vLLM reads only the first part, into a preceding assistant with no content yet.
        text = _part_text(content[0]) if content else ""
        if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("content"):
            messages[-1]["content"] = text
        else:
            messages.append({"role": "assistant", "content": text})
        return
    if isinstance(content, list):
        content = [
            {"type": "text", "text": _part_text(part)}
            if isinstance(part, dict) and part.get("type") in _TEXT_PARTS
            else part
            for part in content
        ]
    elif not isinstance(content, str):
        raise invalid("input", "a message's content must be a string or a list of parts")
    messages.append({"role": role, "content": content})


def _assistant(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message a tool call or reasoning joins: the last one, else new."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": None})
    return messages[-1]


def _part_text(part: Any) -> str:
    return str(part.get("text", "")) if isinstance(part, dict) else ""


def _reasoning_text(item: Mapping[str, Any]) -> str:
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts:
            return _part_text(parts[0])
    return ""
