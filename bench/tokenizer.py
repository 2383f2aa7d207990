"""The simulator's stand-in tokenizer and chat template.

Rule: a token is 4 UTF-8 bytes. Every piece of the rendered prompt (a message's role
header, its content, its end marker) is encoded on its own and padded with ``0xFF``
(a byte UTF-8 never produces) to a multiple of 4 bytes, so each piece is a whole number
of tokens. Because pieces never share a token, appending messages only appends tokens,
exactly as with a real chat template whose pieces are separated by special tokens.

A tokenized prompt is kept as ``bytes`` (4 bytes per token) rather than a list of ints:
slicing and hashing 16-token blocks of it is cheap, and a 100K-token prompt is one
400 KB object instead of 100K Python ints.

The template is ChatML-shaped::

    <|im_start|>{role}\n  {content}  <|im_end|>\n   ... then <|im_start|>assistant\n

Text the simulated engine generates is made of 4-byte ASCII tokens, so an assistant
reply sent back in the next turn re-tokenizes to the very tokens that were generated.
A reply that calls a tool is its generated text as the call's ``input`` argument; the
template writes such a call back as that text, so the call too re-tokenizes to what was
generated, as a real model's call does under its own template (Qwen3 writes back the
``<tool_call>`` it generated). Other calls are written as their JSON.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson

from router.index.prefix import content_text
from router.wire.blocks import TOKEN_BYTES, token_bytes

_PAD = b"\xff"

IM_START = "<|im_start|>"
# How the simulated engine's call arguments begin (bench.sim.openai_api builds them).
CALL_ARGUMENTS_HEAD = '{"input": "'
IM_END = "<|im_end|>\n"


def encode_piece(text: str) -> bytes:
    """Encode one template piece: UTF-8, padded to a whole number of tokens."""
    raw = text.encode("utf-8")
    short = -len(raw) % TOKEN_BYTES
    return raw + _PAD * short if short else raw


def num_tokens(encoded: bytes) -> int:
    return len(encoded) // TOKEN_BYTES


def encode_token_ids(ids: Iterable[int]) -> bytes:
    """Encode a completions prompt given as token ids (each must fit in 32 bits)."""
    return token_bytes(ids)


def _render_message(message: Mapping[str, Any]) -> list[bytes]:
    role = str(message.get("role", "user"))
    pieces = [encode_piece(f"{IM_START}{role}\n")]
    text = content_text(message.get("content"))
    if text:
        pieces.append(encode_piece(text))
    tool_calls = message.get("tool_calls")
    if tool_calls:
        pieces.extend(encode_piece(call_text(call)) for call in tool_calls)
    pieces.append(encode_piece(IM_END))
    return pieces


def call_text(call: Any) -> str:
    """A call as the template writes it: the generated text of a call whose arguments are
    ``{"input": text}`` (``bench.sim.openai_api.call_arguments_head``), else its JSON."""
    function = call.get("function") if isinstance(call, Mapping) else None
    arguments = function.get("arguments") if isinstance(function, Mapping) else None
    if isinstance(arguments, str) and arguments.startswith(CALL_ARGUMENTS_HEAD):
        try:
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and set(parsed) == {"input"}:
            text = parsed["input"]
            if isinstance(text, str):
                return text
    return orjson.dumps(call, option=orjson.OPT_SORT_KEYS).decode()


GENERATION_PROMPT = encode_piece(f"{IM_START}assistant\n")


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> bytes:
    """Tokenize a chat conversation with the fixed template."""
    pieces: list[bytes] = []
    for message in messages:
        pieces.extend(_render_message(message))
    if add_generation_prompt:
        pieces.append(GENERATION_PROMPT)
    return b"".join(pieces)
