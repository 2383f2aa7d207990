"""Response shapes of vLLM 0.34's Anthropic Messages API (simulated): the message, its
server-sent events, ``count_tokens``, usage and errors
(``docs/engines/vllm-messages-responses.md`` §1.3-1.6). The request side is
``router.apis.anthropic_chat.py``; the endpoints are ``bench/sim/api.py``'s.

* The id is chat's: ``chatcmpl-`` and the ``X-Request-Id`` header, else 16 hex digits.
* usage: vLLM reports the cache split only with ``--enable-prompt-tokens-details``; the
  simulated engine always reports chat's ``prompt_tokens_details``, so it always sends
  ``cache_read_input_tokens`` (the prefix-cache hit) and ``cache_creation_input_tokens``
  (the prompt's full blocks it computed), and ``input_tokens`` is the rest of the prompt.
* A stream is ``message_start`` (usage with ``output_tokens`` 0), one text block
  (``content_block_start``, ``content_block_delta``…, ``content_block_stop``),
  ``message_delta`` with the full usage, ``message_stop``; each frame has an ``event:``
  line; no ``ping``, no ``[DONE]``.
* Errors of the handler: ``{"type": "error", "error": {type, message}}``, the type from
  the status.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from bench.sim.request import SimRequest
from bench.sim.request_fields import ApiError

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def message_id(request_id: str | None) -> str:
    return "chatcmpl-" + (request_id or uuid.uuid4().hex[:16])


def error_body(exc: ApiError) -> dict[str, Any]:
    """vLLM's ``translate_error_response``: the status decides the type."""
    default = "api_error" if exc.status >= 500 else "invalid_request_error"
    kind = _ERROR_TYPES.get(exc.status, default)
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def usage(sim: SimRequest, block_tokens: int, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage: the prompt split into read from the cache, written to it (its
    full blocks not read: vLLM's ``num_cache_creation_tokens``) and the rest."""
    read = sim.cached_tokens
    created = sim.cache_written_tokens(block_tokens)
    return {
        "input_tokens": max(0, sim.prompt_tokens - read - created),
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": read,
    }


def message_body(rid: str, model: str, sim: SimRequest, block_tokens: int) -> dict[str, Any]:
    """A non-streamed answer (vLLM dumps it without nulls: no ``stop_sequence``)."""
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": sim.output_text()}],
        "model": model,
        "stop_reason": STOP_REASONS.get(sim.finish_reason or "length"),
        "usage": usage(sim, block_tokens, sim.output_tokens),
    }


def count_tokens_body(prompt_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "context_management": {"original_input_tokens": prompt_tokens},
    }


def frame(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


_BLOCK_STOP = frame("content_block_stop", {"type": "content_block_stop", "index": 0})
_MESSAGE_STOP = frame("message_stop", {"type": "message_stop"})


class MessageEvents:
    """The events of one streamed message, handed out as the request advances (an
    ``sse.Events``). ``message_start`` goes out with the first token, as vLLM's role
    chunk does, and with it the text block's start."""

    __slots__ = ("_block_tokens", "_model", "_rid", "_started", "sent")

    def __init__(self, rid: str, model: str, block_tokens: int) -> None:
        self._rid, self._model, self._block_tokens = rid, model, block_tokens
        self._started = False
        self.sent = 0  # output tokens already handed out

    def due(self, sim: SimRequest) -> bytes:
        """The events since the last call; at the end, the last of them."""
        events: list[bytes] = []
        if not self._started:
            self._started = True
            events.append(self._message_start(sim))
        if sim.output_tokens > self.sent:
            if self.sent == 0:
                start = {"type": "text", "text": ""}
                events.append(
                    frame(
                        "content_block_start",
                        {"type": "content_block_start", "content_block": start, "index": 0},
                    )
                )
            delta = {"type": "text_delta", "text": sim.output_text(self.sent)}
            events.append(
                frame(
                    "content_block_delta",
                    {"type": "content_block_delta", "delta": delta, "index": 0},
                )
            )
            self.sent = sim.output_tokens
        if sim.finished:
            if self.sent:
                events.append(_BLOCK_STOP)
            stop = {"stop_reason": STOP_REASONS.get(sim.finish_reason or ""), "stop_sequence": None}
            end_usage = usage(sim, self._block_tokens, sim.output_tokens)
            events.append(
                frame("message_delta", {"type": "message_delta", "delta": stop, "usage": end_usage})
            )
            events.append(_MESSAGE_STOP)
        return b"".join(events)

    def _message_start(self, sim: SimRequest) -> bytes:
        message: dict[str, Any] = {
            "id": self._rid,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self._model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(sim, self._block_tokens, 0),
        }
        return frame("message_start", {"type": "message_start", "message": message})
