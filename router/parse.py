"""Client requests: validate the body and compute its prefix key, once per request."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from router.errors import BadRequest
from router.prefix import PrefixKey, chain_seed, prefix_key, render_chat, render_prompt

Kind = Literal["chat", "completion"]


@dataclass(frozen=True, slots=True)
class ClientRequest:
    kind: Kind
    model: str
    body: bytes  # forwarded unchanged
    stream: bool
    session_key: str | None
    key: PrefixKey
    record_reply: bool  # whether the reply can extend the chain (text prompts only)


def _check_messages(messages: Any) -> Sequence[Mapping[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}] must be an object", param="messages")
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}].role must be a string", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(f"messages[{i}].content must be a string or an array",
                             param="messages")
    return messages


def _prompt(value: Any) -> str | Sequence[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value
    ):
        return value
    if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        first: str = value[0]
        return first  # a batch: route by its first prompt
    raise BadRequest("'prompt' must be a string, an array of strings or an array of token ids",
                     param="prompt")


def session_key_of(body: Mapping[str, Any], header: str | None,
                   fields: Sequence[str]) -> str | None:
    if header:
        return header
    for name in fields:
        value = body.get(name)
        if isinstance(value, str) and value:
            return value
    return None


def parse_request(kind: Kind, raw: bytes, session_header: str | None,
                  session_fields: Sequence[str], block_bytes: int) -> ClientRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise BadRequest("'stream' must be a boolean", param="stream")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest("'cache_salt' must be a string", param="cache_salt")
    if kind == "chat":
        canonical = render_chat(_check_messages(body.get("messages")))
        record_reply = True
    else:
        prompt = _prompt(body.get("prompt"))
        canonical = render_prompt(prompt)
        record_reply = isinstance(prompt, str)
    return ClientRequest(
        kind=kind,
        model=model,
        body=raw,
        stream=bool(stream),
        session_key=session_key_of(body, session_header, session_fields),
        key=prefix_key(canonical, block_bytes, chain_seed(model, salt)),
        record_reply=record_reply,
    )
