"""Response shapes of vLLM 0.32's Anthropic Messages API (simulated): the message, its
server-sent events, ``count_tokens``, usage and errors
(``docs/engines/vllm-messages-responses.md`` §1.3-1.6 and §6). The request side is
``router.apis.anthropic_chat.py``; the endpoints are ``bench/sim/api.py``'s.

* The id is chat's: ``chatcmpl-`` and the ``X-Request-Id`` header, else 16 hex digits.
* usage: vLLM reports the cache split only with ``--enable-prompt-tokens-details``; the
  simulated engine always reports chat's ``prompt_tokens_details``, so the whole reply and
  ``message_delta`` always send ``cache_read_input_tokens`` (the prefix-cache hit) and
  ``cache_creation_input_tokens`` (the prompt's full blocks it computed), and
  ``input_tokens`` is the rest of the prompt. ``message_start``'s usage is the first chat
  chunk's, which has no cache split: the whole prompt as ``input_tokens`` and 0 output.
* A stream is ``message_start``, one text block (``content_block_start`` at the first
  non-empty text, ``content_block_delta``…, ``content_block_stop``; none without text),
  ``message_delta`` with the full usage, ``message_stop``; each frame has an ``event:``
  line; no ``ping``, no ``[DONE]``.
* Errors of the handler: ``{"type": "error", "error": {type, message}}``, the type vLLM's
  own (``BadRequestError``, ``NotFoundError``…): 0.32 does not map it to Anthropic's.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from bench.sim.request import SimRequest
from bench.sim.request_fields import ApiError

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def message_id(request_id: str | None) -> str:
    return "chatcmpl-" + (request_id or uuid.uuid4().hex[:16])


def error_body(exc: ApiError) -> dict[str, Any]:
    """vLLM's ``translate_error_response``: the OpenAI error's type and message."""
    return {"type": "error", "error": {"type": exc.err_type, "message": exc.message}}


def usage(sim: SimRequest, block_tokens: int) -> dict[str, int]:
    """Anthropic's usage: the prompt split into read from the cache, written to it (its
    full blocks not read: vLLM's ``num_cache_creation_tokens``) and the rest."""
    read = sim.cached_tokens
    created = sim.cache_written_tokens(block_tokens)
    return {
        "input_tokens": max(0, sim.prompt_tokens - read - created),
        "output_tokens": sim.output_tokens,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": read,
    }


def stop_reason(finish_reason: str | None) -> str | None:
    """vLLM's ``_to_anthropic_stop_reason`` without tools or stop strings; an abort has
    none."""
    return STOP_REASONS.get(finish_reason or "stop")


def message_body(rid: str, model: str, sim: SimRequest, block_tokens: int) -> dict[str, Any]:
    """A non-streamed answer (vLLM dumps it without nulls: no ``stop_sequence``)."""
    body: dict[str, Any] = {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": sim.output_text()}],
        "model": model,
        "stop_reason": stop_reason(sim.finish_reason),
        "usage": usage(sim, block_tokens),
    }
    if body["stop_reason"] is None:
        del body["stop_reason"]
    return body


def count_tokens_body(prompt_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "context_management": {"original_input_tokens": prompt_tokens},
    }


def frame(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


_BLOCK_START = frame(
    "content_block_start",
    {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0},
)
_BLOCK_STOP = frame("content_block_stop", {"type": "content_block_stop", "index": 0})
_MESSAGE_STOP = frame("message_stop", {"type": "message_stop"})


class MessageEvents:
    """The events of one streamed message, handed out as the request advances (an
    ``sse.Events``). ``message_start`` goes out with the first token, as vLLM's role
    chunk does; the text block opens at the first non-empty text, as vLLM skips empty
    deltas."""

    __slots__ = ("_block_tokens", "_model", "_opened", "_rid", "_started", "sent")

    def __init__(self, rid: str, model: str, block_tokens: int) -> None:
        self._rid, self._model, self._block_tokens = rid, model, block_tokens
        self._started = False
        self._opened = False  # the text block was started
        self.sent = 0  # output tokens already handed out

    def due(self, sim: SimRequest) -> bytes:
        """The events since the last call; at the end, the last of them."""
        events: list[bytes] = []
        if not self._started:
            self._started = True
            events.append(self._message_start(sim))
        if sim.output_tokens > self.sent:
            events.extend(self._text(sim.output_text(self.sent)))
            self.sent = sim.output_tokens
        if sim.finished:
            events.extend(self._end(sim))
        return b"".join(events)

    def _text(self, text: str) -> list[bytes]:
        if not text:
            return []
        events = [] if self._opened else [_BLOCK_START]
        self._opened = True
        delta = {"type": "text_delta", "text": text}
        data = {"type": "content_block_delta", "delta": delta, "index": 0}
        return [*events, frame("content_block_delta", data)]

    def _end(self, sim: SimRequest) -> list[bytes]:
        events = [_BLOCK_STOP] if self._opened else []
        stop = {"stop_reason": stop_reason(sim.finish_reason), "stop_sequence": None}
        data = {"type": "message_delta", "delta": stop, "usage": usage(sim, self._block_tokens)}
        return [*events, frame("message_delta", data), _MESSAGE_STOP]

    def _message_start(self, sim: SimRequest) -> bytes:
        message: dict[str, Any] = {
            "id": self._rid,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self._model,
            "stop_reason": None,
            "stop_sequence": None,
            # The first chat chunk's usage: no cache split yet.
            "usage": {"input_tokens": sim.prompt_tokens, "output_tokens": 0},
        }
        return frame("message_start", {"type": "message_start", "message": message})
