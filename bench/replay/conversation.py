"""The growing message list of one replayed session.

Each turn's request carries the whole conversation so far: the system prompt (if the
session has one), every earlier user message with the reply the server actually
streamed back, then the new user message. Replaying the server's own replies (not the
trace's) is what lets the next turn hit the KV blocks the engine cached for them.
"""

from __future__ import annotations

from typing import Any

from bench.replay.api_streams import ToolCall
from bench.tokenizer import call_text, encode_piece, render_chat
from bench.workloads.api_bodies import Message
from bench.workloads.trace import TextSpec, Turn, render_text


class Conversation:
    """Committed turns only: a turn that failed leaves no trace in later requests.

    Dropping the failed turn's user message too (not just its missing reply) keeps the
    roles alternating, which many chat templates insist on. A turn after a reply that
    called a tool sends its message as that tool's result.
    """

    __slots__ = ("_call", "_messages")

    def __init__(self, system: TextSpec | None = None) -> None:
        self._messages: list[Message] = []
        self._call: ToolCall | None = None  # the last committed reply's call
        if system is not None:
            self._messages.append({"role": "system", "content": render_text(system)})

    def request(self, turn: Turn) -> tuple[Message, ...]:
        """The messages of the turn's request: the history, then its new message."""
        text = render_text(turn.user)
        if self._call is not None:
            message: Message = {"role": "tool", "tool_call_id": self._call.id, "content": text}
        else:
            message = {"role": "user", "content": text}
        return (*self._messages, message)

    def commit(
        self, request: tuple[Message, ...], reply: str, call: ToolCall | None = None
    ) -> None:
        """``request(turn)`` succeeded: its new message and the reply join the history."""
        self._messages.append(dict(request[-1]))
        answer: dict[str, Any] = {"role": "assistant", "content": reply}
        if call is not None:
            function = {"name": call.name, "arguments": call.arguments}
            answer["tool_calls"] = [{"id": call.id, "type": "function", "function": function}]
        self._messages.append(answer)
        self._call = call


def tokenize_prompt(messages: tuple[Message, ...]) -> bytes:
    """The prompt as the simulator's chat template tokenizes it."""
    return render_chat(messages)


def tokenize_reply(reply: str, call: ToolCall | None = None) -> bytes:
    """The generated tokens behind a reply, its text or its call (the simulator's replies
    re-encode exactly)."""
    if call is not None:
        function = {"name": call.name, "arguments": call.arguments}
        return encode_piece(reply + call_text({"function": function}))
    return encode_piece(reply)
