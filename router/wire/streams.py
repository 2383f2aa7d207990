"""A reply in each client API, as whoever reads it in passing needs it: its text, its
errors and the engine's usage (``docs/engines/vllm-messages-responses.md`` §1.3-1.4,
§2.3-2.4). The router's reply capture (``router.apis.capture``, ``router.apis``) and the
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


# More tokens than any one request has (a trillion): a count beyond it is not one.
MAX_TOKEN_COUNT = 1 << 40


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None  # None: not reported
    cached_tokens: int | None  # None: the engine did not say (not "none cached")
    completion_tokens: int
    # A field was there but not a token count (negative, absurd, not an int, more
    # cached than prompted): it was taken as unknown.
    rejected: bool = False


def count(value: Any) -> int | None:
    """A token count from a usage field: a whole number from 0 to ``MAX_TOKEN_COUNT``,
    else unknown."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_COUNT:
        return value
    return None


def _checked(prompt: Any, cached: Any, completion: Any) -> Usage:
    """The counts an engine reported, any that is not one taken as unknown."""
    counts = (count(prompt), count(cached), count(completion))
    rejected = any(
        raw is not None and value is None
        for raw, value in zip((prompt, cached, completion), counts, strict=True)
    )
    prompt_tokens, cached_tokens, completion_tokens = counts
    if prompt_tokens is not None and cached_tokens is not None and cached_tokens > prompt_tokens:
        cached_tokens, rejected = None, True
    return Usage(prompt_tokens, cached_tokens, completion_tokens or 0, rejected)


def _details(usage: Mapping[str, Any], name: str) -> Any:
    details = usage.get(name)
    return details.get("cached_tokens") if isinstance(details, dict) else None


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
    return _checked(
        usage.get("prompt_tokens"),
        _details(usage, "prompt_tokens_details"),
        usage.get("completion_tokens"),
    )


def responses_usage(usage: Mapping[str, Any]) -> Usage:
    return _checked(
        usage.get("input_tokens"),
        _details(usage, "input_tokens_details"),
        usage.get("output_tokens"),
    )


def anthropic_usage(usage: Mapping[str, Any]) -> Usage:
    """Anthropic's ``usage``, every field seen so far (``merge_anthropic_usage``)."""
    raw = [usage.get(name) for name in ANTHROPIC_PROMPT_PARTS]
    parts = [count(value) for value in raw]
    rejected = any(r is not None and p is None for r, p in zip(raw, parts, strict=True))
    prompt = sum(p for p in parts if p is not None) if parts[0] is not None else None
    checked = _checked(prompt, raw[1], usage.get("output_tokens"))
    return Usage(
        checked.prompt_tokens,
        checked.cached_tokens,
        checked.completion_tokens,
        rejected or checked.rejected,
    )


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
