"""Request parsing and response shapes of vLLM's OpenAI-compatible API (simulated)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from bench.tokenizer import IM_END, encode_piece, encode_token_ids, render_chat

Kind = Literal["chat", "completion"]


class ApiError(Exception):
    """An error answered with vLLM's error body and an HTTP status."""

    def __init__(
        self, status: int, message: str, err_type: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type or _ERROR_TYPES.get(status, "InternalServerError")
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: Kind
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


def _field(
    body: Mapping[str, Any], name: str, types: type | tuple[type, ...], default: Any = None
) -> Any:
    value = body.get(name)
    if value is None:
        return default
    allowed = types if isinstance(types, tuple) else (types,)
    # bool is an int subclass: never accept it where a number is expected.
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise ApiError(400, f"'{name}' has the wrong type", param=name)
    return value


# The end marker of a message, dropped from the last one by ``continue_final_message``.
_MESSAGE_END = encode_piece(IM_END)


def request_body(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def requested_model(body: Mapping[str, Any], served_model: str) -> str:
    """The model a request names (the served one when it names none); any other is a
    404, as vLLM's model check."""
    model: str = _field(body, "model", str, served_model)
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model")
    return model


def chat_prompt(body: Mapping[str, Any]) -> bytes:
    """``messages`` through the chat template, as vLLM's chat and tokenize requests read
    them: ``add_generation_prompt`` (default true) appends the assistant header;
    ``continue_final_message`` (default false) leaves the last message open, without
    its end marker; the two cannot both be on."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "each message needs a string 'role'", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ApiError(
                400, "message 'content' must be a string or a list of parts", param="messages"
            )
    generation_prompt = _field(body, "add_generation_prompt", bool, True)
    continue_final = _field(body, "continue_final_message", bool, False)
    if generation_prompt and continue_final:
        raise ApiError(
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    if continue_final:
        return render_chat(messages, add_generation_prompt=False)[: -len(_MESSAGE_END)]
    return render_chat(messages, add_generation_prompt=generation_prompt)


def completion_prompt(body: Mapping[str, Any], allow_token_ids: bool = True) -> bytes:
    """``prompt`` tokenized: a string, or (when ``allow_token_ids``) a list of 32-bit token
    ids taken as they are. A batch of one is unwrapped; larger batches are refused."""
    prompt = body.get("prompt")
    if (
        allow_token_ids
        and isinstance(prompt, list)
        and len(prompt) == 1
        and isinstance(prompt[0], str | list)
    ):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return encode_piece(prompt)
    if not allow_token_ids:
        raise ApiError(400, "'prompt' must be a string", param="prompt")
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in prompt)
    ):
        return encode_token_ids(prompt)
    raise ApiError(
        400,
        "'prompt' must be a string or a non-empty list of token ids "
        "(batched prompts are not simulated)",
        param="prompt",
    )


def parse_request(kind: Kind, body: Any, served_model: str, max_model_len: int) -> ParsedRequest:
    body = request_body(body)
    model = requested_model(body, served_model)
    if _field(body, "n", int, 1) != 1:
        raise ApiError(400, "only n=1 is simulated", param="n")
    prompt = chat_prompt(body) if kind == "chat" else completion_prompt(body)
    prompt_tokens = len(prompt) // 4
    requested = _field(body, "max_completion_tokens", int) or _field(body, "max_tokens", int)
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
    min_tokens = _field(body, "min_tokens", int, 0)
    ignore_eos = bool(_field(body, "ignore_eos", bool, False))
    stream_options = _field(body, "stream_options", dict, {})
    return ParsedRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        exact_length=ignore_eos or min_tokens >= max_tokens,
        stream=bool(_field(body, "stream", bool, False)),
        include_usage=bool(stream_options.get("include_usage", False)),
        seed=_field(body, "seed", int),
        cache_salt=_field(body, "cache_salt", str),
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
    )


def new_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def stream_chunk(
    kind: Kind,
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

    def __init__(self, kind: Kind, rid: str, model: str, created: int) -> None:
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
    kind: Kind, rid: str, model: str, created: int, usage_body: dict[str, Any]
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
    kind: Kind,
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
