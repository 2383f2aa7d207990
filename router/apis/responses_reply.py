"""An OpenAI Responses reply as the router reads it
(``docs/engines/vllm-messages-responses.md`` §2.3-2.4).

* Its id (``resp_…``): the response the engine stores, which a later request may
  continue (``previous_response_id``) or fetch; the stream names it in
  ``response.created``.
* A client that sends the whole conversation each turn sends the output items back:
  vLLM reads the first content part of an assistant ``message`` and merges each
  ``function_call`` into it as a chat tool call (``router.apis.responses_chat``); the
  capture rebuilds that. A reply of several messages is not rebuilt.
* A request continuing the response (``previous_response_id``) carries its output as
  the engine stored it: one assistant message per content part of each ``message``
  item, no function calls. The capture keeps the key of that conversation
  (``continuation``) where it is the reply chain's: a reply of one part (its text
  alone, before any tool calls), or of none (the prompt's key, where the chain knows
  it); a reply of several parts leaves it unknown.
* usage (in ``response.completed`` or ``response.incomplete``, or the whole object):
  ``input_tokens`` is the whole prompt, ``input_tokens_details.cached_tokens`` the hit.
"""

from __future__ import annotations

from typing import Any

from router.apis.capture import ReplyCapture
from router.wire.streams import (
    RESPONSES_ENDED,
    RESPONSES_FAILED,
    RESPONSES_TEXT_DELTA,
    responses_usage,
    stream_error,
)


class ResponsesCapture(ReplyCapture):
    __slots__ = ("_message_at", "_messages", "_parts")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._messages = 0  # message output items seen
        self._message_at: Any = None  # the streamed message item's output_index
        self._parts = 0  # content parts of message items seen

    def _event(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        if kind == RESPONSES_TEXT_DELTA:
            if not obj.get("content_index"):  # vLLM reads a message's first part only
                self._text(obj.get("delta"))
        elif kind == "response.output_item.added":
            self._item_added(obj.get("item"), obj.get("output_index"))
        elif kind == "response.content_part.added":
            if obj.get("output_index") == self._message_at:
                self._parts += 1
        elif kind == "response.output_item.done":
            item = obj.get("item")
            if isinstance(item, dict) and item.get("type") == "function_call":
                self._function_call(item)
        elif kind == "response.created":
            self._identify(obj.get("response"))
        elif kind in RESPONSES_ENDED:
            self.ended = True
            response = obj.get("response")
            if isinstance(response, dict):
                self._read_usage(response.get("usage"))
        elif kind in (RESPONSES_FAILED, "error") or stream_error(obj) is not None:
            self.errored = True
            if kind == RESPONSES_FAILED:
                self.ended = True

    def _item_added(self, item: Any, output_index: Any = None) -> None:
        if isinstance(item, dict) and item.get("type") == "function_call":
            self.called_tool = True
        if isinstance(item, dict) and item.get("type") == "message":
            self._messages += 1
            self._message_at = output_index
            if self._messages > 1:
                self._give_up()

    def _function_call(self, item: dict[str, Any]) -> None:
        self._tool_call(item.get("call_id"), item.get("name"), item.get("arguments"))

    def _identify(self, response: Any) -> None:
        if isinstance(response, dict) and isinstance(response.get("id"), str):
            self.response_id = response["id"]

    def _whole(self, obj: dict[str, Any]) -> None:
        self._identify(obj)
        if obj.get("status") == "failed" or obj.get("object") == "error":
            self.errored = True
            return
        for item in obj.get("output") or ():
            if not isinstance(item, dict):
                continue
            if item.get("type") == "message":
                self._item_added(item)
                content = item.get("content")
                if isinstance(content, list):
                    self._parts += len(content)
                if isinstance(content, list) and content and isinstance(content[0], dict):
                    self._text(content[0].get("text"))
            elif item.get("type") == "function_call":
                self._function_call(item)
        self._read_usage(obj.get("usage"))

    async def settle(self) -> None:
        """The reply is complete: its text is in the chain, its tool calls not yet."""
        await super().settle()
        chain = self._extender
        if chain is None or self.broken or self.errored:
            return
        if self._parts == 1:
            self.continuation = chain.key()
        elif self._parts == 0:
            self.continuation = chain.unreplied_key()

    def _read_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self._take_usage(responses_usage(usage))
