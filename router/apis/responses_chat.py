"""An OpenAI Responses request's ``instructions`` and ``input`` as the chat messages vLLM
0.34 renders (``docs/engines/vllm-messages-responses.md`` §2.2;
``openai/responses/utils.py::construct_input_messages``): what the router keys a
Responses request by, and what the simulated engine runs.

The chat messages are, in order:

1. ``instructions``, if any, as one system message;
2. with ``previous_response_id``: the stored messages that prompted that response (its
   own earlier turns included) without their system messages (instructions do not
   carry over), then one assistant message per content part of each of its ``message``
   output items (only the engine that stored it has these);
3. the new ``input``: a string is one user message; a list's items are read one by one:
   a message with a role passes through (an assistant ``message`` item as the text of
   its first part), ``function_call`` becomes an assistant's tool call,
   ``function_call_output`` a ``tool`` message, ``reasoning`` an assistant's
   reasoning. Any other item type is refused.

Not followed: continuing a final assistant message left ``in_progress`` (vLLM's
``continue_final_message``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.apis.invalid import InvalidBody

# Content part types vLLM's chat renderer reads as text.
_TEXT_PARTS = ("input_text", "output_text", "text")


def chat_messages(
    instructions: str | None,
    new_input: Sequence[Mapping[str, Any]],
    history: Sequence[Mapping[str, Any]] = (),
    previous_output: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """The request's chat messages (steps 1-3 above): ``new_input`` is
    ``input_messages(input)``; ``history`` and ``previous_output`` the stored messages
    and output of ``previous_response_id``."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages.extend(dict(m) for m in history if m.get("role") != "system")
    for item in previous_output:
        if item.get("type") == "message":
            messages.extend(
                {"role": "assistant", "content": part.get("text", "")}
                for part in item.get("content") or ()
            )
    messages.extend(dict(m) for m in new_input)
    return messages


def input_messages(given: Any) -> list[dict[str, Any]]:
    """The new ``input`` as chat messages (step 3 above)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list):
        raise InvalidBody("input", "Input should be a valid string or list")
    messages: list[dict[str, Any]] = []
    for item in given:
        if not isinstance(item, dict):
            raise InvalidBody("input", "each input item must be an object")
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
            raise InvalidBody("input", f"Unsupported input item type: {kind}", validation=False)
    return messages


def _add_message(messages: list[dict[str, Any]], item: Mapping[str, Any]) -> None:
    role, content = item["role"], item.get("content")
    if not isinstance(role, str):
        raise InvalidBody("input", "a message's role must be a string")
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
        raise InvalidBody("input", "a message's content must be a string or a list of parts")
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
