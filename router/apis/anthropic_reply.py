"""An Anthropic Messages reply as the router reads it, and the errors it answers in
Anthropic's shape (``docs/engines/vllm-messages-responses.md`` §1.3-1.5).

* The next turn carries the reply as an assistant message of ``text`` and ``tool_use``
  blocks, which vLLM converts to chat's content and ``tool_calls`` (arguments
  ``json.dumps(input)``; ``router.apis.anthropic_chat``): the capture rebuilds that.
* usage: the prompt is ``input_tokens`` plus ``cache_read_input_tokens`` and
  ``cache_creation_input_tokens``; the cache hit is ``cache_read_input_tokens``, which
  vLLM reports only with ``--enable-prompt-tokens-details`` (else unknown). A stream
  has it in ``message_start`` and, final, in ``message_delta``.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from router.apis.capture import MAX_TOOL_CALL_BYTES, ReplyCapture
from router.errors import RouterError
from router.wire.streams import (
    ANTHROPIC_ENDED,
    anthropic_text_delta,
    anthropic_usage,
    merge_anthropic_usage,
)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (vLLM's ``translate_error_response``)."""
    default = "api_error" if status >= 500 else "invalid_request_error"
    return ERROR_TYPES.get(status, default)


def error_body(error: RouterError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(error.status), "message": error.message}}


class MessagesCapture(ReplyCapture):
    __slots__ = ("_tool_input", "_tool_use", "_usage_seen")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tool_use: dict[str, Any] | None = None  # the tool_use block streaming
        self._tool_input: list[str] = []
        self._usage_seen: dict[str, Any] = {}

    def _event(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        if kind == "content_block_delta":
            self._delta(obj)
        elif kind == "content_block_start":
            block = obj.get("content_block")
            if isinstance(block, dict) and block.get("type") == "tool_use":
                self.called_tool = True
                self._tool_use, self._tool_input = block, []
        elif kind == "content_block_stop" and self._tool_use is not None:
            block, self._tool_use = self._tool_use, None
            self._streamed_tool_use(block, "".join(self._tool_input))
        elif kind == "message_start":
            message = obj.get("message")
            if isinstance(message, dict):
                self._read_usage(message.get("usage"))
        elif kind == "message_delta":
            self._read_usage(obj.get("usage"))
        elif kind == ANTHROPIC_ENDED:
            self.ended = True
        elif kind == "error":
            self.errored = True

    def _delta(self, event: dict[str, Any]) -> None:
        text = anthropic_text_delta(event)
        if text is not None:
            self._text(text)
            return
        delta = event.get("delta")
        if not isinstance(delta, dict):
            return
        if delta.get("type") == "input_json_delta" and self._tool_use is not None:
            part = delta.get("partial_json")
            if isinstance(part, str):
                self._tool_input.append(part)
                self._tool_bytes += len(part)
                if self._tool_bytes > MAX_TOOL_CALL_BYTES:
                    self._give_up()

    def _streamed_tool_use(self, block: dict[str, Any], streamed: str) -> None:
        try:
            given = orjson.loads(streamed) if streamed else block.get("input")
        except orjson.JSONDecodeError:
            self._give_up()
            return
        self._tool_use_call(block, given)

    def _tool_use_call(self, block: dict[str, Any], given: Any) -> None:
        # vLLM: json.dumps(block.input or {}), stdlib spacing and ASCII escapes.
        try:
            arguments = json.dumps(given or {})
        except (RecursionError, TypeError, ValueError):
            self._give_up()
            return
        self._tool_call(block.get("id"), block.get("name"), arguments)

    def _whole(self, obj: dict[str, Any]) -> None:
        if obj.get("type") == "error":
            self.errored = True
            return
        for block in obj.get("content") or ():
            if not isinstance(block, dict):
                continue
            if block.get("type") == "text":
                self._text(block.get("text"))
            elif block.get("type") == "tool_use":
                self._tool_use_call(block, block.get("input"))
        self._read_usage(obj.get("usage"))

    def _read_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            merge_anthropic_usage(self._usage_seen, usage)
            self._take_usage(anthropic_usage(self._usage_seen))
