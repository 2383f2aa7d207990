"""Request parsing and response shapes of vLLM's OpenAI-compatible API (simulated)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from bench.sim.prompts import STAND_IN, Prompts, encode_prompt
from bench.sim.request_fields import ApiError, field, request_body, requested_model
from router.wire.kinds import PromptKind


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: PromptKind
    model: str
    prompt: bytes
    max_tokens: int
    exact_length: bool
    stream: bool
    include_usage: bool
    seed: int | None
    cache_salt: str | None
    min_tokens: int
    ignore_eos: bool

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt) // 4


async def parse_request(
    kind: PromptKind, body: Any, served_model: str, max_model_len: int, prompts: Prompts = STAND_IN
) -> ParsedRequest:
    """A completion request checked as vLLM checks it, its prompt encoded by ``prompts``."""
    body = request_body(body)
    model = requested_model(body, served_model)
    if field(body, "n", int, 1) != 1:
        raise ApiError(400, "only n=1 is simulated", param="n")
    prompt = await encode_prompt(prompts, kind, body)
    prompt_tokens = len(prompt) // 4
    requested = field(body, "max_completion_tokens", int) or field(body, "max_tokens", int)
    if requested is not None and requested < 1:
        raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
    max_tokens = requested if requested is not None else max_model_len - prompt_tokens
    if prompt_tokens + max(max_tokens, 1) > max_model_len or max_tokens < 1:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
            param="messages" if kind == "chat" else "prompt",
        )
    min_tokens = field(body, "min_tokens", int, 0)
    ignore_eos = bool(field(body, "ignore_eos", bool, False))
    stream_options = field(body, "stream_options", dict, {})
    return ParsedRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        exact_length=ignore_eos or min_tokens >= max_tokens,
        stream=bool(field(body, "stream", bool, False)),
        include_usage=bool(stream_options.get("include_usage", False)),
        seed=field(body, "seed", int),
        cache_salt=field(body, "cache_salt", str),
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
    )


def new_id(kind: PromptKind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def stream_chunk(
    kind: PromptKind,
    rid: str,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None,
    first: bool = False,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0}
    if kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    if finish_reason is not None:
        choice["stop_reason"] = None
    return {
        "id": rid,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def sse_event(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


# A text no chunk carries, whose JSON splits a chunk's encoding around its text.
_TEXT_MARK = "\x00"
_TEXT_MARK_JSON = orjson.dumps(_TEXT_MARK)


class ChunkEvents:
    """``sse_event(stream_chunk(...))`` of one stream's text chunks without building and
    encoding the dict each time: the bytes around the text are encoded once per finish
    reason, from ``stream_chunk`` itself, and the text alone is encoded per chunk.
    ``tests/test_sim_shortcuts.py`` checks the two give the same bytes."""

    __slots__ = ("_created", "_frames", "_kind", "_model", "_rid")

    def __init__(self, kind: PromptKind, rid: str, model: str, created: int) -> None:
        self._kind, self._rid, self._model, self._created = kind, rid, model, created
        self._frames: dict[str | None, tuple[bytes, bytes]] = {}

    def text(self, text: str, finish_reason: str | None) -> bytes:
        frame = self._frames.get(finish_reason)
        if frame is None:
            chunk = stream_chunk(
                self._kind, self._rid, self._model, self._created, _TEXT_MARK, finish_reason
            )
            # The text follows the id and the model, which may hold anything: the last mark.
            head, _, tail = sse_event(chunk).rpartition(_TEXT_MARK_JSON)
            frame = self._frames[finish_reason] = (head, tail)
        return frame[0] + orjson.dumps(text) + frame[1]


def usage_chunk(
    kind: PromptKind, rid: str, model: str, created: int, usage_body: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body,
    }


def full_response(
    kind: PromptKind,
    rid: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str,
    usage_body: dict[str, Any],
) -> dict[str, Any]:
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "tool_calls": [],
                "reasoning_content": None,
            },
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_body,
        "prompt_logprobs": None,
    }


def models_body(model: str, max_model_len: int, owned_by: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": int(time.time()),
                "owned_by": owned_by,
                "root": model,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [],
            }
        ],
    }
