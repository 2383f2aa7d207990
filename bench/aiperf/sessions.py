"""Conversations in aiperf's ``multi_turn`` custom dataset format (JSONL, one line each).

A line is ``{"session_id", "turns": [...]}``; a leading ``role: system`` turn becomes the
conversation's system message, sent with every turn, and each other turn is the next
user message. aiperf sends a turn with the whole conversation so far, its own earlier
turns and the replies it received, so each turn's prompt extends the last one's: the
prefix a cache-aware router should find on the engine that served the last turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.textgen import text_for


@dataclass(frozen=True, slots=True)
class SessionShape:
    """``sessions`` conversations of ``turns`` turns each. Sizes are in the simulated
    engine's tokens (a real tokenizer counts roughly as many); ``key`` seeds the text,
    so two shapes with different keys share no prefix."""

    sessions: int = 8
    turns: int = 4
    system_tokens: int = 1000
    user_tokens: int = 200
    output_tokens: int = 64
    key: str = "aiperf"

    def __post_init__(self) -> None:
        sizes = (self.sessions, self.turns, self.system_tokens, self.user_tokens)
        if min(*sizes, self.output_tokens) < 1:
            raise ValueError("sessions, turns and token counts must be at least 1")

    @property
    def requests(self) -> int:
        return self.sessions * self.turns


def session_id(index: int) -> str:
    return f"session-{index}"


def conversation(shape: SessionShape, index: int) -> dict[str, Any]:
    prefix = f"{shape.key}-{index}"
    system = {"role": "system", "text": text_for(f"{prefix}-system", shape.system_tokens)}
    turns = [
        {
            "text": text_for(f"{prefix}-user{turn}", shape.user_tokens),
            "output_length": shape.output_tokens,
        }
        for turn in range(shape.turns)
    ]
    return {"session_id": session_id(index), "turns": [system, *turns]}


def write_sessions(shape: SessionShape, path: Path) -> Path:
    lines = (orjson.dumps(conversation(shape, i)) + b"\n" for i in range(shape.sessions))
    path.write_bytes(b"".join(lines))
    return path
