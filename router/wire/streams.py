"""A reply in each client API, as whoever reads it in passing needs it: its text, its
errors and the engine's usage (``docs/engines/vllm-messages-responses.md`` §1.3-1.4,
§2.3-2.4). The router's reply capture (``router.capture``, ``router.apis``) and the
replay's stream readers (``bench.replay.api_streams``) both read replies through these.

* Chat Completions: text in ``choices[0].delta.content`` (streamed) or
  ``choices[0].message.content``; completions ``choices[0].text``; usage
  ``prompt_tokens``, ``prompt_tokens_details.cached_tokens`` (vLLM: only with
  ``--enable-prompt-tokens-details``), ``completion_tokens``; ends at ``[DONE]``.
* Responses: text in ``response.output_text.delta`` events; usage in the terminal
  ``response.completed`` or ``response.incomplete`` event's ``response.usage``:
  ``input_tokens`` (the whole prompt), ``input_tokens_details.cached_tokens``,
  ``output_tokens``; ``response.failed`` is a failure.
* Anthropic Messages: text in ``content_block_delta`` events with a ``text_delta``;
  usage in ``message_start.message.usage``, updated by ``message_delta.usage`` (a later
  one may carry only some fields): the prompt is ``input_tokens +
  cache_read_input_tokens + cache_creation_input_tokens``, the hit
  ``cache_read_input_tokens`` (vLLM: only with prompt-token details); ends at
  ``message_stop``.

An error inside a stream is a chunk with an ``error`` (OpenAI's and Anthropic's shapes)
or SGLang's ``{"object": "error", "message": …}``.

A stream's terminal event (``[DONE]``, ``message_stop``, ``response.completed``,
``response.incomplete``, ``response.failed``) is the last thing its engine sends; the end
of the HTTP body may come in a later write (vLLM's uvicorn sends each event, and then the
body's end, on its own), and a client may close as soon as it has the terminal event.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RESPONSES_TEXT_DELTA = "response.output_text.delta"
RESPONSES_ENDED = ("response.completed", "response.incomplete")
RESPONSES_FAILED = "response.failed"
CHAT_DONE = "[DONE]"
ANTHROPIC_ENDED = "message_stop"
ANTHROPIC_PROMPT_PARTS = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None  # None: not reported
    cached_tokens: int | None  # None: the engine did not say (not "none cached")
    completion_tokens: int


def count(value: Any) -> int | None:
    """A token count from a usage field: an int, else unknown."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _details(usage: Mapping[str, Any], name: str) -> int | None:
    details = usage.get(name)
    return count(details.get("cached_tokens")) if isinstance(details, dict) else None


def stream_error(chunk: Any) -> str | None:
    """The message of an error chunk (vLLM's, SGLang's, Anthropic's), else None; a chunk
    that is not an object is an error too."""
    if not isinstance(chunk, dict):
        return "malformed chunk"
    error = chunk.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, dict) else error
        return f"stream error: {message}"
    if chunk.get("object") == "error":
        return f"stream error: {chunk.get('message')}"
    return None


def first_choice(chunk: Mapping[str, Any]) -> dict[str, Any] | None:
    choices = chunk.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


def chat_usage(usage: Mapping[str, Any]) -> Usage:
    """Chat Completions' and Completions' ``usage``."""
    return Usage(
        count(usage.get("prompt_tokens")),
        _details(usage, "prompt_tokens_details"),
        count(usage.get("completion_tokens")) or 0,
    )


def responses_usage(usage: Mapping[str, Any]) -> Usage:
    return Usage(
        count(usage.get("input_tokens")),
        _details(usage, "input_tokens_details"),
        count(usage.get("output_tokens")) or 0,
    )


def anthropic_usage(usage: Mapping[str, Any]) -> Usage:
    """Anthropic's ``usage``, every field seen so far (``merge_anthropic_usage``)."""
    parts = [count(usage.get(name)) for name in ANTHROPIC_PROMPT_PARTS]
    prompt = sum(p for p in parts if p is not None) if parts[0] is not None else None
    return Usage(prompt, parts[1], count(usage.get("output_tokens")) or 0)


def merge_anthropic_usage(seen: dict[str, Any], usage: Any) -> None:
    """A later usage overrides the fields it carries; the rest stand."""
    if isinstance(usage, dict):
        seen.update((k, v) for k, v in usage.items() if v is not None)


def anthropic_text_delta(event: Mapping[str, Any]) -> str | None:
    """A ``content_block_delta`` event's text, if it is a ``text_delta``."""
    delta = event.get("delta")
    if isinstance(delta, dict) and delta.get("type") == "text_delta":
        text = delta.get("text")
        return text if isinstance(text, str) else None
    return None
