"""An Anthropic Messages request (``POST /v1/messages``, ``/v1/messages/count_tokens``)
checked and turned into the chat completion request vLLM 0.34 runs it as: what the
router keys a Messages request by, and what the simulated engine runs.

vLLM's ``AnthropicServingMessages`` (``entrypoints/anthropic/serving.py``) is a chat
server: it converts the request (``to_chat_completion_request``) and runs the chat path,
so a conversation's prompt, and the prefix cache it hits, is the same through either API.
The rules are in ``docs/engines/vllm-messages-responses.md`` §1.1-1.2:

* ``system``: a string as is; a block list's ``text`` blocks joined with no separator,
  Claude Code's billing header block dropped; one leading system message if non-empty.
* a message's string content is kept; a block list becomes parts (a lone text part: a
  plain string), ``tool_use`` blocks the assistant's ``tool_calls``, ``thinking`` its
  ``reasoning``. A user's ``tool_result`` becomes a ``tool`` message placed before the
  rest of that user message (its images a user message after it); a user message left
  with no content is not sent. An assistant's ``tool_result`` is a text part.
* ``max_tokens`` is copied to ``max_tokens`` and ``max_completion_tokens``,
  ``stop_sequences`` to ``stop``, ``tools`` to functions, ``tool_choice`` to its chat name.

A body that does not fit the request model raises ``InvalidBody`` (vLLM answers it as
its pydantic validation does: a 400 in OpenAI's shape, ``type`` "Bad Request", ``param``
"body.<field>"; vLLM 0.34 registers no Anthropic validation handler). Not
simulated: merging inline system messages for templates that refuse them (a startup
probe in vLLM), ``tool_reference`` items, ``tool_addition``/``tool_removal`` blocks,
``thinking``/``output_config`` (accepted, without effect).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from router.apis.invalid import InvalidBody

# A text block Claude Code starts its system prompt with; left out of the prompt, as vLLM
# leaves it out.
BILLING_HEADER = "x-anthropic-billing-header"

# vLLM's VLLM_MAX_STOP_STRINGS.
MAX_STOP_SEQUENCES = 4
ROLES = ("user", "assistant", "system")
BLOCK_TYPES = (
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
    "tool_addition",
    "tool_removal",
)
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Request fields passed on to the chat request as they are.
_PASSED_ON = ("temperature", "top_p", "top_k", "min_tokens", "cache_salt", "chat_template_kwargs")


def chat_request(body: Any, count_only: bool = False) -> dict[str, Any]:
    """The chat completion body vLLM runs a Messages request as; ``count_only``: a
    ``count_tokens`` request (no ``max_tokens``, never streamed)."""
    if not isinstance(body, dict):
        raise InvalidBody("", "Input should be a valid dictionary", "dict_type")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidBody("model", "Field required" if model is None else "model must be non-empty")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidBody("messages", "Field required" if messages is None else "must be a list")
    chat: dict[str, Any] = {
        "model": model,
        "messages": [*_system_message(body.get("system")), *chat_messages(messages)],
    }
    if not count_only:
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            raise InvalidBody("max_tokens", "Field required", "missing")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise InvalidBody("max_tokens", "max_tokens must be a positive integer")
        chat["max_tokens"] = chat["max_completion_tokens"] = max_tokens
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise InvalidBody("stream", "Input should be a valid boolean", "bool_type")
        chat["stream"] = stream
        chat.update(_stop(body.get("stop_sequences")))
        chat.update({k: body[k] for k in _PASSED_ON if body.get(k) is not None})
    elif body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    chat.update(_tools(body.get("tools"), body.get("tool_choice")))
    return chat


def _system_message(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        text = system
    elif isinstance(system, list):
        text = "".join(
            block["text"]
            for block in _blocks(system, "system")
            if block["type"] == "text" and not str(block["text"]).startswith(BILLING_HEADER)
        )
    else:
        raise InvalidBody("system", "Input should be a valid string or list")
    return [{"role": "system", "content": text}] if text else []


def chat_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The messages in chat form (§1.2 step 2)."""
    converted: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise InvalidBody("messages", f"each message needs a role of {', '.join(ROLES)}")
        role, content = message["role"], message.get("content")
        if isinstance(content, str):
            if role != "system" or content:
                converted.append({"role": role, "content": content})
        elif isinstance(content, list):
            converted.extend(_block_message(role, _blocks(content, "messages")))
        else:
            raise InvalidBody("messages", "content must be a string or a list of blocks")
    return converted


def _blocks(blocks: list[Any], name: str) -> list[Mapping[str, Any]]:
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") not in BLOCK_TYPES:
            raise InvalidBody(name, f"each content block needs a type of {', '.join(BLOCK_TYPES)}")
        if block["type"] == "text" and not isinstance(block.get("text"), str):
            raise InvalidBody(name, "a text block needs a string 'text'")
    return blocks


def _block_message(role: str, blocks: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One message's blocks: the messages they become (tool results first)."""
    before: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text" and block["text"]:
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image_part(block.get("source")))
        elif kind == "thinking":
            reasoning.append(str(block.get("thinking") or ""))
        elif kind == "tool_use":
            tool_calls.append(_tool_call(block))
        elif kind == "tool_result" and role == "user":
            before.extend(_tool_result(block))
        elif kind == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {block.get('content')}"})
    if role == "system":
        text = "".join(part["text"] for part in parts if part["type"] == "text")
        return [{"role": "system", "content": text}] if text else []
    message: dict[str, Any] = {"role": role}
    if len(parts) == 1 and parts[0]["type"] == "text":
        message["content"] = parts[0]["text"]
    elif parts:
        message["content"] = parts
    if tool_calls:
        message["tool_calls"] = tool_calls
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if role == "user" and "content" not in message:
        return before
    return [*before, message]


def _tool_call(block: Mapping[str, Any]) -> dict[str, Any]:
    arguments = block.get("input") or {}
    return {
        "id": block.get("id") or f"call_{int(time.time())}",
        "type": "function",
        "function": {"name": block.get("name"), "arguments": json.dumps(arguments)},
    }


def _tool_result(block: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A user's ``tool_result``: the ``tool`` message, then a user message of its images."""
    content = block.get("content")
    images: list[dict[str, Any]] = []
    if isinstance(content, list):
        texts = []
        for item in content:
            if isinstance(item, dict) and item.get("type") == "text":
                texts.append(str(item.get("text", "")))
            elif isinstance(item, dict) and item.get("type") == "image":
                images.append(_image_part(item.get("source")))
        text = "\n".join(texts)
    else:
        text = "" if content is None else str(content)
    result = [{"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text}]
    if images:
        result.append({"role": "user", "content": images})
    return result


def _image_part(source: Any) -> dict[str, Any]:
    if not isinstance(source, dict):
        raise InvalidBody("messages", "an image block needs a source")
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type')};base64,{source.get('data')}"
    else:
        url = str(source.get("url", ""))
    return {"type": "image_url", "image_url": {"url": url}}


def _stop(stop_sequences: Any) -> dict[str, Any]:
    if stop_sequences is None:
        return {}
    if not isinstance(stop_sequences, list) or not all(isinstance(s, str) for s in stop_sequences):
        raise InvalidBody("stop_sequences", "Input should be a valid list of strings", "list_type")
    if len(stop_sequences) > MAX_STOP_SEQUENCES:
        raise InvalidBody("stop_sequences", f"at most {MAX_STOP_SEQUENCES} stop sequences")
    return {"stop": stop_sequences}


def _tools(tools: Any, tool_choice: Any) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as chat functions (``tool_choice`` "auto" when
    there are tools and no choice)."""
    chat: dict[str, Any] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidBody("tools", "Input should be a valid list", "list_type")
        chat["tools"] = [_function(tool) for tool in tools]
    if tool_choice is not None:
        if not isinstance(tool_choice, dict):
            raise InvalidBody("tool_choice", "Input should be a valid dictionary", "dict_type")
        kind = tool_choice.get("type")
        if kind == "tool":
            if not isinstance(tool_choice.get("name"), str):
                raise InvalidBody("tool_choice", "tool_choice of type 'tool' needs a name")
            chat["tool_choice"] = {"type": "function", "function": {"name": tool_choice["name"]}}
        elif kind in TOOL_CHOICES:
            chat["tool_choice"] = TOOL_CHOICES[kind]
        else:
            raise InvalidBody("tool_choice", "type must be one of auto, any, tool, none")
        chat["parallel_tool_calls"] = not tool_choice.get("disable_parallel_tool_use", False)
    elif chat.get("tools"):
        chat["tool_choice"] = "auto"
    return chat


def _function(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise InvalidBody("tools", "each tool needs a string 'name'")
    if tool.get("type") not in (None, "custom"):
        raise InvalidBody("tools", f"tool type {tool.get('type')!r} is not supported")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise InvalidBody("tools", "each tool needs an 'input_schema' object")
    function = {
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": schema if "type" in schema else {"type": "object", **schema},
    }
    function.update({k: tool[k] for k in ("strict", "defer_loading") if tool.get(k) is not None})
    return {"type": "function", "function": function}
