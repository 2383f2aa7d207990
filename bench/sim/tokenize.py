"""vLLM's tokenizer endpoints, simulated: ``/tokenize``, ``/detokenize`` and the render
endpoints ``/v1/chat/completions/render`` and ``/v1/completions/render``.

The token ids are the simulated engine's own tokens: the prompt ``parse_request`` builds
(chat template included) cut into 4-byte tokens, each read as a little-endian uint32, the
inverse of ``bench.tokenizer.encode_token_ids``. So ids from ``/tokenize`` sent back as a
``/v1/completions`` prompt are the very tokens, and hit the very cache blocks, of the
request they were tokenized from; ``/detokenize`` turns them back into the text.

Schemas, as vLLM's ``vllm/entrypoints/serve/tokenize/protocol.py``:

* ``POST /tokenize`` takes a completion body (``prompt``: a string, ``add_special_tokens``
  default true) or a chat body (``messages``, ``add_generation_prompt`` default true,
  ``continue_final_message``, ``add_special_tokens`` default false, ``chat_template``,
  ``chat_template_kwargs``, ``tools``), both with optional ``model`` and
  ``return_token_strs``; it answers ``{count, max_model_len, tokens, token_strs}``.
* ``POST /detokenize`` takes ``{model?, tokens}`` and answers ``{prompt}``.
* The render endpoints (vLLM 0.18 on, ``vllm/entrypoints/serve/render/``) take a whole
  chat or completion request and answer what would be generated from: a
  ``GenerateRequest`` (``request_id``, ``token_ids``, ``sampling_params``, ...); for
  completions a list of them, one per prompt.

The simulated tokenizer adds no special tokens, so ``add_special_tokens`` changes nothing;
its template ignores ``tools``, as ``/v1/chat/completions`` does, so both agree.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

from bench.sim.openai_api import (
    ApiError,
    Kind,
    ParsedRequest,
    chat_prompt,
    completion_prompt,
    new_id,
    request_body,
    requested_model,
)
from bench.tokenizer import TOKEN_BYTES, encode_token_ids

_PAD = 0xFF  # the filler a template piece is padded with; UTF-8 never produces it
_VOCAB = 2**32  # every 4-byte token is an id


def token_ids(encoded: bytes) -> list[int]:
    """The ids of a tokenized prompt: each 4-byte token as a little-endian uint32."""
    return list(struct.unpack(f"<{len(encoded) // TOKEN_BYTES}I", encoded))


def token_text(encoded: bytes) -> str:
    """Tokens as text: the padding dropped, bytes that are not UTF-8 replaced by U+FFFD
    (as a byte-level tokenizer decodes ids that split a character)."""
    return encoded.replace(bytes([_PAD]), b"").decode("utf-8", errors="replace")


def tokenize(body: Any, served_model: str, max_model_len: int) -> dict[str, Any]:
    """A ``TokenizeResponse`` for a chat body (it has ``messages`` and no ``prompt``) or a
    completion body. Unlike a completion it is not checked against the context length."""
    body = request_body(body)
    requested_model(body, served_model)
    if "prompt" not in body and "messages" not in body:
        raise ApiError(400, "either 'prompt' (a completion) or 'messages' (a chat) is required")
    chat = "prompt" not in body
    if chat:
        _check_chat_options(body)
    else:
        _check_bool(body, "add_special_tokens")
    encoded = chat_prompt(body) if chat else completion_prompt(body, allow_token_ids=False)
    ids = token_ids(encoded)
    strs = None
    if _check_bool(body, "return_token_strs"):
        strs = [
            token_text(encoded[i : i + TOKEN_BYTES]) for i in range(0, len(encoded), TOKEN_BYTES)
        ]
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: Any, served_model: str) -> dict[str, Any]:
    """A ``DetokenizeResponse``: the text of ``tokens``."""
    body = request_body(body)
    requested_model(body, served_model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise ApiError(400, "'tokens' must be a list of integers", param="tokens")
    for token in tokens:
        if not 0 <= token < _VOCAB:
            raise ApiError(400, f"Token id {token} is out of vocabulary", param="tokens")
    return {"prompt": token_text(encode_token_ids(tokens))}


def render(kind: Kind, parsed: ParsedRequest, model: str | None) -> dict[str, Any]:
    """The ``GenerateRequest`` vLLM's render endpoint answers for a request that passed
    ``parse_request``; ``model`` is the one the request named. ``sampling_params``
    carries the fields the simulator models."""
    sampling = {
        "n": 1,
        "max_tokens": parsed.max_tokens,
        "min_tokens": parsed.min_tokens,
        "ignore_eos": parsed.ignore_eos,
        "seed": parsed.seed,
    }
    stream_options = None
    if parsed.stream:
        stream_options = {"include_usage": parsed.include_usage, "continuous_usage_stats": False}
    return {
        "request_id": new_id(kind),
        "token_ids": token_ids(parsed.prompt),
        "features": None,
        "sampling_params": sampling,
        "model": model,
        "stream": parsed.stream,
        "stream_options": stream_options,
        "cache_salt": parsed.cache_salt,
        "priority": 0,
        "kv_transfer_params": None,
    }


def _check_chat_options(body: Mapping[str, Any]) -> None:
    _check_bool(body, "add_special_tokens")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ApiError(
            400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs"
        )
    # vLLM refuses a template sent with the request unless started with
    # --trust-request-chat-template; the simulator has one fixed template.
    if body.get("chat_template") is not None or (kwargs or {}).get("chat_template") is not None:
        raise ApiError(
            400,
            "Chat template is passed with request, but "
            "--trust-request-chat-template is not set. Refused request with "
            "untrusted chat template.",
            param="chat_template",
        )
    tools = body.get("tools")
    if tools is not None and not _all_objects(tools):
        raise ApiError(400, "'tools' must be a list of objects", param="tools")


def _all_objects(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(v, dict) for v in values)


def _check_bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean", param=name)
    return bool(value)
