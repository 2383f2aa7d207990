"""Reading one streamed reply, in each API the replay speaks, into a ``StreamOutcome``.

A reader is fed the stream's server-sent events in order (``feed``) and says when the
stream is over; a stream that stops before that is an error (``end_missing``). What each
reads (``docs/engines/vllm-messages-responses.md`` §1.4, §2.4):

* ``chat``: ``data:`` chunks; text in ``choices[].delta.content``, a tool call in
  ``choices[].delta.tool_calls`` (its id and name first, its arguments in pieces);
  usage in the chunk ``stream_options.include_usage`` adds (``prompt_tokens``,
  ``prompt_tokens_details.cached_tokens``, ``completion_tokens``); ends at ``[DONE]``.
* ``responses``: typed events; text in ``response.output_text.delta``'s ``delta``; usage
  in the terminal ``response.completed`` (or ``response.incomplete``, a reply cut at
  ``max_output_tokens``) event's ``response.usage``: ``input_tokens`` (the whole
  prompt), ``input_tokens_details.cached_tokens``, ``output_tokens``. No ``[DONE]``.
  ``response.failed`` is an error. (vLLM 0.34 sends nothing on a failure mid-stream: the
  stream just stops, which is an error here too.)
* ``messages``: Anthropic events; text in ``content_block_delta``s whose delta is a
  ``text_delta``; usage in ``message_start.message.usage``, updated by the final
  ``message_delta.usage``: the prompt is ``input_tokens + cache_read_input_tokens +
  cache_creation_input_tokens`` (Anthropic counts the cache apart), the cached part
  ``cache_read_input_tokens``. Ends at ``message_stop``.

In every API an ``error`` event, or a chunk with an ``error`` object (OpenAI's and
Anthropic's shapes, SGLang's ``object: "error"``), ends the stream with an error. TTFT
is the time of the first non-empty text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import orjson

from bench.replay.sse import SseEvent
from bench.workloads.api_bodies import Api
from router.wire.streams import (
    ANTHROPIC_ENDED,
    CHAT_DONE,
    RESPONSES_ENDED,
    RESPONSES_FAILED,
    RESPONSES_TEXT_DELTA,
    Usage,
    anthropic_text_delta,
    anthropic_usage,
    chat_usage,
    first_choice,
    merge_anthropic_usage,
    responses_usage,
    stream_error,
)

# Error bodies are only kept for the record; a page of HTML is not worth more.
MAX_ERROR_CHARS = 300


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class StreamOutcome:
    """What came back; times are wall-clock seconds from sending the request."""

    status: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    reply: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    worker: str | None = None
    error: str | None = None
    tool_call: ToolCall | None = None  # the reply's (first) tool call, chat only
    retry_after_s: float | None = None  # the wait a refusal asks for, in seconds


def _take_usage(outcome: StreamOutcome, usage: Usage) -> None:
    outcome.prompt_tokens = usage.prompt_tokens
    outcome.cached_tokens = usage.cached_tokens or 0
    outcome.completion_tokens = usage.completion_tokens


class StreamReader:
    """One stream's reader: the outcome it fills, the reply's text so far; what every
    API shares (decoding an event, error events, the text and its TTFT)."""

    __slots__ = ("_parts", "outcome")
    end_missing: ClassVar[str] = "stream ended early"  # the error when it stops early

    def __init__(self, outcome: StreamOutcome) -> None:
        self.outcome = outcome
        self._parts: list[str] = []

    def reply(self) -> str:
        return "".join(self._parts)

    def feed(self, event: SseEvent, elapsed: float) -> bool:
        """Take the next event, ``elapsed`` seconds after the request was sent; True:
        the stream is over (its end arrived, or ``outcome.error`` says why not)."""
        raise NotImplementedError

    def _load(self, event: SseEvent) -> dict[str, Any] | None:
        """The event's JSON; None (with ``outcome.error`` set) for an error or junk."""
        try:
            chunk = orjson.loads(event.data)
        except orjson.JSONDecodeError:
            self.outcome.error = f"undecodable chunk: {event.data[:MAX_ERROR_CHARS]}"
            return None
        error = stream_error(chunk)
        if error is None and (event.event == "error" or chunk.get("type") == "error"):
            error = f"stream error: {event.data[:MAX_ERROR_CHARS]}"
        if error is not None:
            self.outcome.error = error[:MAX_ERROR_CHARS]
            return None
        assert isinstance(chunk, dict)  # stream_error refuses anything else
        return chunk

    def _text(self, text: Any, elapsed: float) -> None:
        if isinstance(text, str) and text:
            if self.outcome.ttft_s is None:
                self.outcome.ttft_s = elapsed
            self._parts.append(text)


class ChatStream(StreamReader):
    __slots__ = ("_call_head", "_call_parts")
    end_missing: ClassVar[str] = f"stream ended before {CHAT_DONE}"

    def __init__(self, outcome: StreamOutcome) -> None:
        super().__init__(outcome)
        self._call_head: tuple[str, str] | None = None
        self._call_parts: list[str] = []

    def feed(self, event: SseEvent, elapsed: float) -> bool:
        if event.data.strip() == CHAT_DONE:
            return True
        chunk = self._load(event)
        if chunk is None:
            return True
        choice = first_choice(chunk)
        delta = choice.get("delta") if choice is not None else None
        if isinstance(delta, dict):
            self._text(delta.get("content"), elapsed)
            calls = delta.get("tool_calls")
            if isinstance(calls, list) and calls:
                self._call(calls[0], elapsed)
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            _take_usage(self.outcome, chat_usage(usage))
        return False

    def _call(self, call: Any, elapsed: float) -> None:
        """A piece of the reply's first tool call (its head names the call; later calls
        of the same reply are not read)."""
        if not isinstance(call, dict) or call.get("index", 0) != 0:
            return
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        if self._call_head is None and isinstance(call.get("id"), str):
            self._call_head = (call["id"], str(function.get("name") or ""))
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            self._call_parts.append(arguments)
        if self.outcome.ttft_s is None:
            self.outcome.ttft_s = elapsed
        if self._call_head is not None:
            self.outcome.tool_call = ToolCall(*self._call_head, "".join(self._call_parts))


class ResponsesStream(StreamReader):
    __slots__ = ()
    end_missing: ClassVar[str] = "stream ended before response.completed"

    def feed(self, event: SseEvent, elapsed: float) -> bool:
        chunk = self._load(event)
        if chunk is None:
            return True
        kind = chunk.get("type") or event.event
        if kind == RESPONSES_TEXT_DELTA:
            self._text(chunk.get("delta"), elapsed)
        elif kind in RESPONSES_ENDED:
            usage = (chunk.get("response") or {}).get("usage")
            if isinstance(usage, dict):
                _take_usage(self.outcome, responses_usage(usage))
            return True
        elif kind == RESPONSES_FAILED:
            error = (chunk.get("response") or {}).get("error")
            message = error.get("message") if isinstance(error, dict) else error
            self.outcome.error = f"response failed: {message}"[:MAX_ERROR_CHARS]
            return True
        return False


class MessagesStream(StreamReader):
    __slots__ = ("_usage",)
    end_missing: ClassVar[str] = f"stream ended before {ANTHROPIC_ENDED}"

    def __init__(self, outcome: StreamOutcome) -> None:
        super().__init__(outcome)
        self._usage: dict[str, Any] = {}

    def feed(self, event: SseEvent, elapsed: float) -> bool:
        chunk = self._load(event)
        if chunk is None:
            return True
        kind = chunk.get("type") or event.event
        if kind == "content_block_delta":
            self._text(anthropic_text_delta(chunk), elapsed)
        elif kind == "message_start":
            self._take_usage((chunk.get("message") or {}).get("usage"))
        elif kind == "message_delta":
            self._take_usage(chunk.get("usage"))
        elif kind == ANTHROPIC_ENDED:
            return True
        return False

    def _take_usage(self, usage: Any) -> None:
        merge_anthropic_usage(self._usage, usage)
        _take_usage(self.outcome, anthropic_usage(self._usage))


READERS: dict[Api, type[StreamReader]] = {
    "chat": ChatStream,
    "responses": ResponsesStream,
    "messages": MessagesStream,
}
