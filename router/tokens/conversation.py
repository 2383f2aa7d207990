"""A chat request's messages as vLLM hands them to the chat template.

vLLM (v0.33, ``renderers/chat_utils/chat_message.py`` and ``renderers/hf.py``) does not
pass the client's messages through as sent:

* content: ``None`` is no parts; a string is one text part. In the ``string`` content
  format (templates that print ``message.content``) the text parts are joined with
  "\\n"; in the ``openai`` format (templates that loop over the parts) they stay
  ``{"type": "text", "text": ...}`` parts. A tool message's all-text parts are joined
  either way. Claude Code's per-request billing header line is cut from system text.
* assistant: ``tool_calls`` kept (an empty list dropped), each call's ``arguments`` JSON
  string parsed to an object (invalid or not an object: ``{}``); reasoning, sent as
  ``reasoning`` or ``reasoning_content``, given to the template under both names.
* ``name`` kept when a string, a tool message's ``tool_call_id`` kept.
* ``developer`` messages become ``system`` when the template does not know the role,
  and then every system message is merged into one at the front (joined "\\n\\n").
* tools: each as vLLM's model dumps it: ``{"type", "function": {"name",
  "description", "parameters"}}``, absent fields as null.

The content format is read from the template as vLLM reads it: ``openai`` if some loop
iterates over a message's ``content`` (or over a variable named ``content``),
``string`` otherwise; ``prefix.content_format`` overrides it, as vLLM's
``--chat-template-content-format`` does.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import jinja2
import jinja2.nodes

from router.apis.anthropic_chat import BILLING_HEADER
from router.tokens.template import parse_template

ContentFormat = Literal["string", "openai"]


def template_conversation(
    messages: Sequence[Mapping[str, Any]], content_format: ContentFormat, template_source: str
) -> list[dict[str, Any]]:
    conversation = [_message(m, content_format) for m in messages]
    if any(m["role"] == "developer" for m in conversation) and not _knows_developer(
        template_source
    ):
        conversation = _consolidate_systems(
            [_as_system(m) if m["role"] == "developer" else m for m in conversation]
        )
    return conversation


# Content parts the router renders as vLLM does; media and the rest it cannot (their
# placeholders depend on the model's processor).
TEXT_PARTS = ("text",)


def renders_as_the_engine(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Every content part is text (with its text), so the router's rendering is the
    engine's."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") not in TEXT_PARTS:
                    return False
                if not isinstance(part.get("text"), str):
                    return False
    return True


def template_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    dumped = []
    for tool in tools:
        function = tool.get("function")
        function = function if isinstance(function, Mapping) else {}
        defer_loading = function.get("defer_loading", tool.get("defer_loading"))
        entry: dict[str, Any] = {
            "name": function.get("name"),
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        if function.get("strict") is not None:
            entry["strict"] = function["strict"]
        if defer_loading is not None:
            entry["defer_loading"] = defer_loading
        item: dict[str, Any] = {"type": tool.get("type", "function"), "function": entry}
        if tool.get("defer_loading") is not None:
            item["defer_loading"] = tool["defer_loading"]
        dumped.append(item)
    return dumped


def _message(message: Mapping[str, Any], content_format: ContentFormat) -> dict[str, Any]:
    role = str(message.get("role", ""))
    parts = _parts(message.get("content"))
    if role == "system":
        parts = _without_billing_header(parts)
    texts = [str(p.get("text", "")) for p in parts if p.get("type") == "text"]
    content: Any
    if content_format == "string" or role == "tool":
        content = "\n".join(texts)
    else:
        content = [{"type": "text", "text": t} for t in texts]
    result: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if isinstance(tool_calls, list) and tool_calls:
            result["tool_calls"] = [_with_parsed_arguments(call) for call in tool_calls]
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            result["reasoning"] = reasoning
            result["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        result["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        result["name"] = message["name"]
    if role == "developer":
        result["tools"] = message.get("tools")
    return result


def _parts(content: Any) -> list[Mapping[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [
        p if isinstance(p, Mapping) else {"type": "text", "text": p}
        for p in content
        if isinstance(p, Mapping | str)
    ]


def _without_billing_header(parts: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    kept: list[Mapping[str, Any]] = []
    for part in parts:
        text = part.get("text")
        if part.get("type") == "text" and isinstance(text, str) and text.startswith(BILLING_HEADER):
            rest = text.partition("\n")[2]
            if rest:
                kept.append({**part, "text": rest})
            continue
        kept.append(part)
    return kept


def _with_parsed_arguments(call: Any) -> Any:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if not arguments:
        function["arguments"] = {}
    elif not isinstance(arguments, dict):
        parsed: Any = None
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
        function["arguments"] = parsed if isinstance(parsed, dict) else {}
    return {**call, "function": function}


def _as_system(message: dict[str, Any]) -> dict[str, Any]:
    converted = {**message, "role": "system"}
    converted.pop("tools", None)
    return converted


def _knows_developer(template_source: str) -> bool:
    return '"developer"' in template_source or "'developer'" in template_source


def _consolidate_systems(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    systems: list[str] = []
    others: list[dict[str, Any]] = []
    needed = False
    for i, message in enumerate(conversation):
        if message["role"] != "system":
            others.append(message)
            continue
        needed = needed or i > 0 or bool(systems)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        if content:
            systems.append(content)
    if not needed:
        return conversation
    return [{"role": "system", "content": "\n\n".join(systems)}, *others]


@functools.lru_cache(maxsize=32)
def detect_content_format(template_source: str) -> ContentFormat:
    try:
        tree = parse_template(template_source)
    except jinja2.TemplateSyntaxError:
        return "string"
    return "openai" if any(_loops_over_content(tree)) else "string"


def _loops_over_content(tree: jinja2.nodes.Template) -> Iterator[bool]:
    """Loops whose iterable is some variable's ``content`` (``message.content``,
    ``message['content']``, filtered or sliced) or a variable named ``content``."""
    for loop in tree.find_all(jinja2.nodes.For):
        node: jinja2.nodes.Node | None = loop.iter
        while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
        ):
            node = node.node
        if (
            (isinstance(node, jinja2.nodes.Getattr) and node.attr == "content")
            or (
                isinstance(node, jinja2.nodes.Getitem)
                and isinstance(node.arg, jinja2.nodes.Const)
                and node.arg.value == "content"
            )
            or (isinstance(node, jinja2.nodes.Name) and node.name == "content")
        ):
            yield True
