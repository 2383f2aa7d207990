"""Response shapes of vLLM 0.32's Responses API (simulated): the response object, its
typed server-sent events, usage and errors (``docs/engines/vllm-messages-responses.md``
§2.3-2.5 and §6). The request side is ``bench/sim/responses_request.py``, the store
``bench/sim/responses_store.py``; the endpoints are ``bench/sim/api.py``'s.

* The id is ``resp_`` and 16 hex digits, or the request's ``request_id`` (vLLM's
  extra field) as sent; never ``X-Request-Id``. The one output item is a message
  ``msg_<16 hex>`` whose content is one ``output_text`` part (none if the text is empty).
* Every field of vLLM 0.32's ``ResponsesResponse`` is present, nulls included (0.32 has
  no ``prompt_cache_*`` or ``safety_identifier`` in it). ``temperature``, ``top_p`` and
  the penalties are the sampling's: the request's, else the model's
  ``generation_config.json``'s, else vLLM's neutral ones.
* status ``completed``, or ``incomplete`` (``incomplete_details.reason``
  "max_output_tokens") when the output hit its length; the message item is always
  ``completed``, as 0.32 builds it.
* usage: ``input_tokens`` is the whole prompt (the cache hit included, unlike
  Anthropic's); ``input_tokens_details.cached_tokens`` the prefix-cache hit, always
  present; ``cache_write_tokens`` the prompt's full blocks not read from the cache
  (vLLM's ``num_cache_creation_tokens``); ``output_tokens_details.reasoning_tokens`` 0
  (no reasoning parser); the ``*_per_turn`` lists empty, as for any non-Harmony model.
* A stream is ``response.created`` and ``response.in_progress`` (the object in progress,
  no output, no usage), then, from the first non-empty text on, ``output_item.added``,
  ``content_part.added``, ``output_text.delta``…, ``output_text.done``,
  ``content_part.done``, ``output_item.done``, and ``response.completed`` with the final
  object (whose status may be ``incomplete``: 0.32 has no ``response.incomplete`` event),
  whose item has the streamed id. Each event has an ``event:`` line and a
  ``sequence_number`` from 0; there is no [DONE]. vLLM sends the first two before the
  prefill ends; here they go out with the first update of the request (its first token).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from bench.sim.request import SimRequest
from bench.sim.request_fields import ApiError
from bench.sim.responses_request import ResponsesRequest

# Fields of the request the response echoes, with vLLM's defaults when not sent.
_ECHOED_DEFAULTS: dict[str, Any] = {"metadata": None, "parallel_tool_calls": True}
_ECHOED_LATER: dict[str, Any] = {
    "max_tool_calls": None,
    "previous_response_id": None,
    "prompt": None,
    "reasoning": None,
    "service_tier": "auto",
}


def response_id(request_id: str | None) -> str:
    return request_id or "resp_" + uuid.uuid4().hex[:16]


def not_found(rid: str) -> ApiError:
    """vLLM's ``_make_not_found_error``."""
    return ApiError(
        404, f"Response with id '{rid}' not found.", "invalid_request_error", "response_id"
    )


def usage(sim: SimRequest, block_tokens: int) -> dict[str, Any]:
    cached = sim.cached_tokens
    written = sim.cache_written_tokens(block_tokens)
    return {
        "input_tokens": sim.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": written,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": sim.output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": sim.prompt_tokens + sim.output_tokens,
    }


def status_of(sim: SimRequest) -> str:
    return "incomplete" if sim.finish_reason == "length" else "completed"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [] if not text else [output_text(text, None)]
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def output_text(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """What a response object holds from the start: its id, the request it echoes, the
    model, the creation time and the effective ``max_output_tokens``."""

    request: ResponsesRequest
    rid: str
    model: str
    created_at: int
    max_tokens: int
    sampling: Mapping[str, float]  # the effective temperature, top_p and penalties

    def body(
        self, status: str, output: list[dict[str, Any]], usage_body: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The response object, in the order of vLLM's ``ResponsesResponse`` fields."""
        given = self.request.body
        tools = given.get("tools") or []
        body: dict[str, Any] = {
            "id": self.rid,
            "created_at": self.created_at,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": self.request.instructions,
            "metadata": None,
            "model": self.model,
            "object": "response",
            "output": output,
        }
        for name, default in _ECHOED_DEFAULTS.items():
            body[name] = given[name] if given.get(name) is not None else default
        body["temperature"] = self.sampling["temperature"]
        # vLLM rewrites "auto" to "none" when there are no tools.
        choice = given.get("tool_choice") or "auto"
        body["tool_choice"] = "none" if not tools and choice == "auto" else choice
        body["tools"] = tools
        body["top_p"] = self.sampling["top_p"]
        body["background"] = self.request.background
        body["max_output_tokens"] = self.max_tokens
        for name, default in _ECHOED_LATER.items():
            body[name] = given[name] if given.get(name) is not None else default
        body.update(
            {
                "status": status,
                "text": given.get("text"),
                "top_logprobs": None,
                "truncation": given.get("truncation") or "disabled",
                "usage": usage_body,
                "user": given.get("user"),
                "presence_penalty": self.sampling["presence_penalty"],
                "frequency_penalty": self.sampling["frequency_penalty"],
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "input_messages": None,
                "output_messages": None,
            }
        )
        return body

    def final(self, sim: SimRequest, item_id: str, block_tokens: int) -> dict[str, Any]:
        """The finished response (one message item, as non-streamed)."""
        item = message_item(item_id, sim.output_text())
        return self.body(status_of(sim), [item], usage(sim, block_tokens))


def new_item_id() -> str:
    return "msg_" + uuid.uuid4().hex[:16]


class ResponseEvents:
    """The typed events of one streamed response, handed out as the request advances
    (an ``sse.Events``); ``final``: the finished object once the last event is out."""

    __slots__ = ("_block_tokens", "_head", "_item_id", "_opened", "_sequence", "final", "sent")

    def __init__(self, head: ResponseHead, block_tokens: int) -> None:
        self._head, self._block_tokens = head, block_tokens
        self._item_id = new_item_id()
        self._sequence = 0
        self._opened = False  # the message item was added (at the first non-empty text)
        self.sent = 0  # output tokens already handed out
        self.final: dict[str, Any] | None = None

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        data["sequence_number"] = self._sequence
        data["type"] = kind
        self._sequence += 1
        # In the order of vLLM's dump of the openai SDK's event models: alphabetical.
        ordered = dict(sorted(data.items()))
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(ordered) + b"\n\n"

    def due(self, sim: SimRequest) -> bytes:
        """The events since the last call; at the end, the last of them."""
        events: list[bytes] = []
        if self._sequence == 0:
            started = self._head.body("in_progress", [], None)
            events.append(self._event("response.created", {"response": started}))
            events.append(self._event("response.in_progress", {"response": started}))
        if sim.output_tokens > self.sent:
            text = sim.output_text(self.sent)
            self.sent = sim.output_tokens
            if text:
                if not self._opened:
                    events.extend(self._open())
                delta = {"content_index": 0, "delta": text, **self._where(), "logprobs": []}
                events.append(self._event("response.output_text.delta", delta))
        if sim.finished:
            events.extend(self._end(sim))
        return b"".join(events)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._item_id, "output_index": 0}

    def _open(self) -> list[bytes]:
        self._opened = True
        item = message_item(self._item_id, "", "in_progress")
        part = {"content_index": 0, **self._where(), "part": output_text("", [])}
        return [
            self._event("response.output_item.added", {"item": item, "output_index": 0}),
            self._event("response.content_part.added", part),
        ]

    def _end(self, sim: SimRequest) -> list[bytes]:
        """The item closed (if one was opened) and ``response.completed``, whatever the
        final status (vLLM 0.32's ``responses_stream_generator``)."""
        events: list[bytes] = []
        output: list[dict[str, Any]] = []
        if self._opened:
            text = sim.output_text()
            where = self._where()
            done = {"content_index": 0, **where, "logprobs": [], "text": text}
            events.append(self._event("response.output_text.done", done))
            part = {"content_index": 0, **where, "part": output_text(text, None)}
            events.append(self._event("response.content_part.done", part))
            item = message_item(self._item_id, text)
            events.append(
                self._event("response.output_item.done", {"item": item, "output_index": 0})
            )
            output.append(item)
        self.final = self._head.body(status_of(sim), output, usage(sim, self._block_tokens))
        events.append(self._event("response.completed", {"response": self.final}))
        return events
