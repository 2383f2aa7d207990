"""The request body of one replayed turn in each API the replay speaks.

A turn is a chat message list (a leading system message, then alternating user and
assistant messages, string content). Each API's body carries the same conversation in
the form its clients send, so vLLM (and the simulated engine) converts it back to the
same chat messages and renders the same prompt (``docs/engines/vllm-messages-responses.md``
§1.2, §2.2), and a session hits the same prefix cache through any of them:

* ``chat``: ``POST /v1/chat/completions``, the messages as they are.
* ``responses``: ``POST /v1/responses``; the leading system message is ``instructions``,
  user messages ``{"role": "user", "content": text}`` input items, assistant messages
  the output-item form a client sends back (one ``output_text`` part).
* ``messages``: ``POST /v1/messages`` (Anthropic); the leading system message is
  ``system``, the rest ``{"role", "content": text}``.

A session whose turns end in tool calls (``Turn.ended_by``) offers its tools on every
chat turn, as agents do (the tools are part of the prompt), and asks for a call
(``tool_choice: "required"``) on the turns that end in one; the next turn sends the tool's
result as a ``tool`` message answering the call. The Responses and Messages bodies carry
no tools: their turns are plain text.

Every body asks for exactly ``max_tokens`` tokens, so replies match the trace: chat and
Responses through vLLM's ``ignore_eos`` extra. vLLM's Anthropic request has no
``ignore_eos`` (unknown fields are ignored), so Messages also sends the vLLM extra
``min_tokens`` equal to ``max_tokens``, which holds the end of sequence back as long.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Api = Literal["chat", "responses", "messages"]
APIS: tuple[Api, ...] = ("chat", "responses", "messages")
DEFAULT_API: Api = "chat"
PATHS: dict[Api, str] = {
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


# A chat message as the replay sends it: string content, and an assistant's tool calls.
Message = Mapping[str, Any]
# The tool an agent session offers: one function whose arguments are free text.
AGENT_TOOLS: tuple[dict[str, Any], ...] = (
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a command in the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"input": {"type": "string"}},
                "required": ["input"],
            },
        },
    },
)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    session: str
    messages: tuple[Message, ...]
    max_tokens: int
    api: Api | None = None  # None: the client's default API
    parent: str | None = None  # the session that spawned this one (a subagent's parent)
    tools: bool = False  # the session offers ``AGENT_TOOLS`` (chat only)
    calls_tool: bool = False  # this turn's reply is to call one


def _split_system(
    messages: tuple[Message, ...],
) -> tuple[str | None, tuple[Message, ...]]:
    """The leading system message's content (None without one) and the rest."""
    if messages and messages[0]["role"] == "system":
        return messages[0]["content"], messages[1:]
    return None, messages


def chat_body(model: str, request: ChatRequest) -> dict[str, Any]:
    return {
        "model": model,
        "messages": list(request.messages),
        "max_tokens": request.max_tokens,
        # vLLM extension: generate exactly max_tokens, so replies match the trace.
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": request.session,
    } | _tool_fields(request)


def _tool_fields(request: ChatRequest) -> dict[str, Any]:
    if not request.tools:
        return {}
    return {"tools": list(AGENT_TOOLS), "tool_choice": "required" if request.calls_tool else "none"}


def _input_item(message: Message) -> dict[str, Any]:
    if message["role"] == "assistant":
        part = {"type": "output_text", "text": message["content"]}
        return {"type": "message", "role": "assistant", "content": [part]}
    # user, and any later system message (vLLM passes role messages through)
    return {"role": message["role"], "content": message["content"]}


def responses_body(model: str, request: ChatRequest) -> dict[str, Any]:
    system, rest = _split_system(request.messages)
    body: dict[str, Any] = {"model": model}
    if system is not None:
        body["instructions"] = system
    body.update(
        {
            "input": [_input_item(m) for m in rest],
            "max_output_tokens": request.max_tokens,
            "stream": True,
            "store": False,  # nothing refers back to it; vLLM stores nothing by default
            "ignore_eos": True,
            "user": request.session,
        }
    )
    return body


def messages_body(model: str, request: ChatRequest) -> dict[str, Any]:
    system, rest = _split_system(request.messages)
    body: dict[str, Any] = {"model": model}
    if system is not None:
        body["system"] = system
    body.update(
        {
            # A later system message stays inline (a vLLM extension to the roles).
            "messages": [{"role": m["role"], "content": m["content"]} for m in rest],
            "max_tokens": request.max_tokens,
            "stream": True,
            "ignore_eos": True,  # ignored by vLLM's Anthropic request; kept for symmetry
            "min_tokens": request.max_tokens,
            "metadata": {"user_id": request.session},
        }
    )
    return body


BODIES: dict[Api, Callable[[str, ChatRequest], dict[str, Any]]] = {
    "chat": chat_body,
    "responses": responses_body,
    "messages": messages_body,
}
