"""vLLM's tokenizer endpoints, simulated: ``/tokenize``, ``/detokenize`` and the render
endpoints ``/v1/chat/completions/render`` and ``/v1/completions/render``.

The token ids are the engine's own tokens: the prompt ``parse_request`` builds (chat
template included) through the engine's ``Prompts`` (``bench/sim/prompts.py``), 4 bytes
per token, each read as a little-endian uint32: the stand-in's 4-byte pieces, or the
model's ids with ``--tokenizer DIR``. So ids from ``/tokenize`` sent back as a
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

The stand-in tokenizer adds no special tokens, so ``add_special_tokens`` changes nothing
there, and its template ignores ``tools``; a model's tokenizer and template honour both,
in ``/tokenize`` and ``/v1/chat/completions`` alike.
"""

from __future__ import annotations

import struct
from typing import Any

from bench.sim.openai_api import ParsedRequest, new_id
from bench.sim.prompts import Prompts, check_vocab, encode_prompt
from bench.sim.request_fields import ApiError, field, request_body, requested_model
from router.wire.blocks import TOKEN_BYTES
from router.wire.kinds import PromptKind


def token_ids(encoded: bytes) -> list[int]:
    """The ids of a tokenized prompt: each 4-byte token as a little-endian uint32."""
    return list(struct.unpack(f"<{len(encoded) // TOKEN_BYTES}I", encoded))


async def tokenize(
    body: Any, served_model: str, max_model_len: int, prompts: Prompts
) -> dict[str, Any]:
    """A ``TokenizeResponse`` for a chat body (it has ``messages`` and no ``prompt``) or a
    completion body. Unlike a completion it is not checked against the context length."""
    body = request_body(body)
    requested_model(body, served_model)
    if "prompt" not in body and "messages" not in body:
        raise ApiError(400, "either 'prompt' (a completion) or 'messages' (a chat) is required")
    kind: PromptKind = "completion" if "prompt" in body else "chat"
    encoded = await encode_prompt(prompts, kind, body, tokenize=True)
    ids = token_ids(encoded)
    strs = None
    if field(body, "return_token_strs", bool, False):
        strs = await prompts.token_strs(ids)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


async def detokenize(body: Any, served_model: str, prompts: Prompts) -> dict[str, Any]:
    """A ``DetokenizeResponse``: the text of ``tokens``."""
    body = request_body(body)
    requested_model(body, served_model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise ApiError(400, "'tokens' must be a list of integers", param="tokens")
    if tokens and min(tokens) < 0:
        raise ApiError(400, f"Token id {min(tokens)} is out of vocabulary", param="tokens")
    check_vocab(tokens, prompts.vocab_size, "tokens")
    return {"prompt": await prompts.decode(tokens)}


def render(kind: PromptKind, parsed: ParsedRequest, model: str | None) -> dict[str, Any]:
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
