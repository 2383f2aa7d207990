"""An OpenAI Responses request (``POST /v1/responses``) checked and turned into the chat
completion request the simulated engine runs, as vLLM 0.34 renders it
(``docs/engines/vllm-messages-responses.md`` §2.1-2.2; ``openai/responses/utils.py::
construct_input_messages``).

The chat messages are, in order:

1. ``instructions``, if any, as one system message;
2. with ``previous_response_id``: the stored messages that prompted that response (its
   own earlier turns included) without their system messages (instructions do not
   carry over), then one assistant message per content part of each of its ``message``
   output items;
3. the new ``input``: a string is one user message; a list's items are read one by one:
   a message with a role passes through (an assistant ``message`` item as the text of
   its first part), ``function_call`` becomes an assistant's tool call,
   ``function_call_output`` a ``tool`` message, ``reasoning`` an assistant's
   reasoning. Any other item type is a 400.

The sampling the response echoes (``temperature``, ``top_p`` and the penalties) is the
request's, else the model's ``generation_config.json``'s, else vLLM's neutral values
(``ResponsesRequest.to_sampling_params``).

A body that does not fit the request model is a pydantic 400 (OpenAI's shape, ``type``
"Bad Request", ``param`` "body.<field>"). Not simulated: continuing a final assistant
message left ``in_progress`` (vLLM's ``continue_final_message``), tools (accepted,
without effect on the prompt), structured output, ``truncation: "auto"``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.sim.request_fields import ApiError, invalid
from router.apis.invalid import InvalidBody
from router.apis.responses_chat import input_messages

# Request fields the chat request takes as they are (vLLM's sampling extras).
_PASSED_ON = ("temperature", "top_p", "top_k", "seed", "cache_salt", "ignore_eos", "stop")
# vLLM's sampling defaults for the fields a response echoes, when neither the request
# nor the model's generation config sets them.
NEUTRAL_SAMPLING: dict[str, float] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A checked request; ``body`` is kept for the fields the response echoes."""

    body: Mapping[str, Any]
    instructions: str | None
    input_messages: list[dict[str, Any]]
    previous_response_id: str | None
    store: bool
    stream: bool
    background: bool
    max_output_tokens: int | None
    request_id: str | None
    sampling: Mapping[str, float]  # the NEUTRAL_SAMPLING fields the request set


def _number(body: Mapping[str, Any], name: str) -> float | None:
    """``body[name]`` as pydantic's lax ``float`` reads JSON: a number, a bool or a
    numeric string."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            message = "Input should be a valid number, unable to parse string as a number"
            raise InvalidBody(name, message, "float_parsing") from None
    if not isinstance(value, int | float):
        raise InvalidBody(name, "Input should be a valid number", "float_type")
    return float(value)


def _optional(body: Mapping[str, Any], name: str, kind: type, type_name: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise InvalidBody(name, f"Input should be a valid {type_name}", f"{type_name}_type")
    return value


def parse(body: Any) -> ResponsesRequest:
    """``body`` checked as vLLM's ``ResponsesRequest`` model checks it."""
    try:
        return _parse(body)
    except InvalidBody as exc:
        raise invalid(exc) from None


def _parse(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise InvalidBody("", "Input should be a valid dictionary", "dict_type")
    if "input" not in body:
        raise InvalidBody("input", "Field required", "missing")
    if body.get("prompt") is not None:
        raise ApiError(400, "prompt template is not supported", param="prompt")
    max_output_tokens = _optional(body, "max_output_tokens", int, "integer")
    if max_output_tokens is not None and max_output_tokens < 1:
        raise InvalidBody("max_output_tokens", "max_output_tokens must be at least 1")
    store = _optional(body, "store", bool, "boolean")
    background = bool(_optional(body, "background", bool, "boolean"))
    if background and store is False:
        raise ApiError(400, "background can only be used when `store` is true", param="background")
    return ResponsesRequest(
        body=body,
        instructions=_optional(body, "instructions", str, "string"),
        input_messages=input_messages(body["input"]),
        previous_response_id=_optional(body, "previous_response_id", str, "string"),
        store=store is not False,
        stream=bool(_optional(body, "stream", bool, "boolean")),
        background=background,
        max_output_tokens=max_output_tokens,
        request_id=_optional(body, "request_id", str, "string"),
        sampling=_given_sampling(body),
    )


def _given_sampling(body: Mapping[str, Any]) -> dict[str, float]:
    given = {name: _number(body, name) for name in NEUTRAL_SAMPLING}
    return {name: value for name, value in given.items() if value is not None}


def sampling(request: ResponsesRequest, model_dir: str | None) -> dict[str, float]:
    """The sampling the response echoes: the request's, else the model's defaults."""
    return {**NEUTRAL_SAMPLING, **model_sampling(model_dir), **request.sampling}


@functools.cache
def model_sampling(model_dir: str | None) -> Mapping[str, float]:
    """The ``NEUTRAL_SAMPLING`` fields ``model_dir/generation_config.json`` sets, as
    vLLM's ``--generation-config auto`` reads them. vLLM reads the model's directory;
    the simulated engine's only model directory is its tokenizer's."""
    if model_dir is None:
        return {}
    try:
        config = orjson.loads((Path(model_dir) / "generation_config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    if not isinstance(config, dict):
        return {}
    return {
        name: float(value)
        for name in NEUTRAL_SAMPLING
        if isinstance(value := config.get(name), int | float) and not isinstance(value, bool)
    }


def check_max_output_tokens(request: ResponsesRequest, max_model_len: int) -> None:
    """vLLM's ``TokenizeParams`` check: asking more than the whole context is a 400 (less
    is clamped to what the prompt leaves)."""
    asked = request.max_output_tokens
    if asked is not None and asked > max_model_len:
        message = (
            f"max_output_tokens={asked} cannot be greater than max_model_len={max_model_len}. "
            f"Please request fewer output tokens. (parameter=max_output_tokens, value={asked})"
        )
        raise ApiError(400, message, param="max_output_tokens")


def chat_body(
    request: ResponsesRequest, model: str, messages: list[dict[str, Any]]
) -> dict[str, Any]:
    """The chat completion body that renders ``messages`` as vLLM renders the request
    (``max_output_tokens`` is applied by the caller: vLLM clamps it to the context)."""
    chat: dict[str, Any] = {"model": model, "messages": messages}
    chat.update({k: request.body[k] for k in _PASSED_ON if request.body.get(k) is not None})
    return chat
