"""The growing message list of one replayed session.

Each turn's request carries the whole conversation so far: the system prompt (if the
session has one), every earlier user message with the reply the server actually
streamed back, then the new user message. Replaying the server's own replies (not the
trace's) is what lets the next turn hit the KV blocks the engine cached for them.
"""

from __future__ import annotations

from collections.abc import Mapping

from bench.tokenizer import encode_piece, render_chat
from bench.workloads.trace import TextSpec, Turn, render_text


class Conversation:
    """Committed turns only: a turn that failed leaves no trace in later requests.

    Dropping the failed turn's user message too (not just its missing reply) keeps the
    roles alternating, which many chat templates insist on.
    """

    __slots__ = ("_messages",)

    def __init__(self, system: TextSpec | None = None) -> None:
        self._messages: list[dict[str, str]] = []
        if system is not None:
            self._messages.append({"role": "system", "content": render_text(system)})

    def request(self, turn: Turn) -> tuple[Mapping[str, str], ...]:
        """The messages of the turn's request: the history, then its user message."""
        return (*self._messages, {"role": "user", "content": render_text(turn.user)})

    def commit(self, request: tuple[Mapping[str, str], ...], reply: str) -> None:
        """``request(turn)`` succeeded: its user message and the reply join the history."""
        self._messages.append(dict(request[-1]))
        self._messages.append({"role": "assistant", "content": reply})


def tokenize_prompt(messages: tuple[Mapping[str, str], ...]) -> bytes:
    """The prompt as the simulator's chat template tokenizes it."""
    return render_chat(messages)


def tokenize_reply(reply: str) -> bytes:
    """The generated tokens behind a reply (the simulator's replies re-encode exactly)."""
    return encode_piece(reply)
