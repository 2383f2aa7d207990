"""Reads a response as it passes through: the reply and the engine's usage.

The reply feeds a ``ReplyChain`` (so the next turn matches its whole history) and is
never kept whole: its text as it streams, its tool calls (bounded) to be appended as the
next turn's assistant message carries them. Usage gives the engine-reported prompt and
cached tokens. Capture is best effort: a line that does not parse, or one longer than
``MAX_LINE_BYTES``, stops capturing and never affects what the client receives.

``ReplyCapture`` reads the stream; each API reads its own events: chat and completions
here, Responses and Messages in ``router.apis``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import orjson

from router.index.prefix import PrefixKey, render_tool_calls
from router.wire.kinds import TurnEnd
from router.wire.streams import CHAT_DONE, Usage, chat_usage, first_choice, stream_error

MAX_LINE_BYTES = 1 << 20
# The most of a reply's tool calls kept until the reply ends.
MAX_TOOL_CALL_BYTES = 1 << 20
_CHAT_DONE = CHAT_DONE.encode()


class ReplyChain(Protocol):
    """Extends a request's chain with its reply: by the reply's text
    (``router.index.prefix.ChainExtender``) or by its tokens (``router.tokens.reply``)."""

    def feed(self, text: str) -> None: ...

    def feed_bytes(self, data: bytes) -> None: ...

    async def settle(self) -> None:
        """The reply is complete: whatever is left to compute is computed."""

    def finish(self) -> list[int]: ...

    def key(self) -> PrefixKey | None:
        """The request's key extended by the reply's text as fed so far (after
        ``settle``): the conversation that carries the reply as one assistant message;
        None where that is not known."""

    def unreplied_key(self) -> PrefixKey | None:
        """The conversation where the reply adds no message; None where not known."""


class ReplyCapture:
    __slots__ = (
        "_extender",
        "_partial",
        "_tool_bytes",
        "_tool_calls",
        "broken",
        "cached_tokens",
        "called_tool",
        "completion_tokens",
        "continuation",
        "ended",
        "errored",
        "prompt_tokens",
        "response_id",
        "usage_rejected",
    )

    def __init__(self, extender: ReplyChain | None) -> None:
        self._extender = extender
        self._partial = bytearray()
        self._tool_calls: list[dict[str, Any]] = []
        self._tool_bytes = 0
        self.errored = False  # the stream carried an error event
        # The stream's terminal event has been read: the engine has sent everything.
        self.ended = False
        self.broken = False  # capture gave up; the reply is incomplete
        self.called_tool = False  # the reply calls a tool (as far as it was read)
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None  # None: the engine did not say
        self.usage_rejected = False  # a usage field was not a token count
        self.completion_tokens = 0
        self.response_id: str | None = None  # a Responses reply's id
        # A Responses reply: the key of the conversation a request continuing it
        # (previous_response_id) goes on from, once settled; None where not known.
        self.continuation: PrefixKey | None = None

    def feed_stream(self, chunk: bytes) -> None:
        """A chunk of an SSE stream (lines may be split across chunks)."""
        if self.broken:
            return
        self._partial += chunk
        if b"\n" not in chunk:
            if len(self._partial) > MAX_LINE_BYTES:
                self._give_up()
            return
        *lines, rest = self._partial.split(b"\n")
        self._partial = bytearray(rest)
        for line in lines:
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload == _CHAT_DONE:
                    self.ended = True
                elif payload:
                    obj = self._parse(payload)
                    if obj is not None:
                        self._event(obj)

    def feed_whole(self, body: bytes) -> None:
        """A complete (non-streaming) JSON response."""
        obj = self._parse(body)
        if obj is not None:
            self._whole(obj)

    def _parse(self, payload: bytes | bytearray) -> dict[str, Any] | None:
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self._give_up()
            return None
        return obj if isinstance(obj, dict) else None

    def _event(self, obj: dict[str, Any]) -> None:
        """One event of a stream."""
        raise NotImplementedError

    def _whole(self, obj: dict[str, Any]) -> None:
        """A whole reply."""
        raise NotImplementedError

    def _text(self, text: Any) -> None:
        if isinstance(text, str) and self._extender is not None:
            self._extender.feed(text)

    @property
    def turn_end(self) -> TurnEnd:
        return "tool" if self.called_tool else "user"

    def _tool_call(self, call_id: Any, name: Any, arguments: Any) -> None:
        """A tool call of the reply, as the next turn's chat message carries it."""
        self.called_tool = True
        if not isinstance(name, str) or not isinstance(arguments, str):
            self._give_up()
            return
        self._tool_bytes += len(name) + len(arguments)
        if self._tool_bytes > MAX_TOOL_CALL_BYTES:
            self._give_up()
            return
        function = {"name": name, "arguments": arguments}
        self._tool_calls.append({"id": call_id, "type": "function", "function": function})

    def _take_usage(self, usage: Usage) -> None:
        self.usage_rejected = self.usage_rejected or usage.rejected
        self.prompt_tokens = usage.prompt_tokens
        self.cached_tokens = usage.cached_tokens
        self.completion_tokens = usage.completion_tokens

    def _give_up(self) -> None:
        self.broken = True
        self._partial = bytearray()

    async def settle(self) -> None:
        """The reply is complete (before ``reply_hashes``)."""
        if self._extender is not None and not self.broken and not self.errored:
            await self._extender.settle()

    def reply_hashes(self) -> list[int]:
        """Hashes the reply adds to the chain; empty if the reply is unusable."""
        if self._extender is None or self.broken or self.errored:
            return []
        if self._tool_calls:
            calls, self._tool_calls = self._tool_calls, []
            self._extender.feed_bytes(render_tool_calls(calls))
        return self._extender.finish()


class ChatCapture(ReplyCapture):
    """A chat completion: ``choices[0].delta.content`` as it streams, ``message.content``
    whole; tool calls as the next turn's assistant message carries them (``id``,
    ``type``, ``function.name``, ``function.arguments``), streamed ones put together from
    their deltas by ``index``."""

    __slots__ = ("_streamed_calls",)

    def __init__(self, extender: ReplyChain | None) -> None:
        super().__init__(extender)
        self._streamed_calls: dict[int, list[Any]] = {}  # index -> [id, name, arguments]

    def _event(self, obj: dict[str, Any]) -> None:
        part = self._part(obj, "delta")
        if part is None:
            return
        self._text(part.get("content"))
        calls = part.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                self._call_delta(call)

    def _call_delta(self, call: Any) -> None:
        self.called_tool = True
        if not isinstance(call, dict) or not isinstance(call.get("index"), int):
            self._give_up()
            return
        entry = self._streamed_calls.setdefault(call["index"], [None, None, ""])
        if call.get("id") is not None:
            entry[0] = call["id"]
        function = call.get("function")
        if isinstance(function, dict):
            if function.get("name") is not None:
                entry[1] = function["name"]
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                entry[2] += arguments
                self._tool_bytes += len(arguments)
                if self._tool_bytes > MAX_TOOL_CALL_BYTES:
                    self._give_up()

    def _whole(self, obj: dict[str, Any]) -> None:
        part = self._part(obj, "message")
        if part is None:
            return
        self._text(part.get("content"))
        calls = part.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                self._give_up()
                return
            self._tool_call(call.get("id"), function.get("name"), function.get("arguments"))

    def _part(self, obj: dict[str, Any], name: str) -> dict[str, Any] | None:
        _take_chat_chunk(self, obj)
        choice = first_choice(obj)
        part = choice.get(name) if choice is not None else None
        return part if isinstance(part, dict) else None

    def reply_hashes(self) -> list[int]:
        calls, self._streamed_calls = self._streamed_calls, {}
        for _, (call_id, name, arguments) in sorted(calls.items()):
            self._tool_call(call_id, name, arguments)
        return super().reply_hashes()


class CompletionCapture(ReplyCapture):
    """A completion: ``choices[0].text``; the next prompt continues it directly."""

    __slots__ = ()

    def _event(self, obj: dict[str, Any]) -> None:
        self._whole(obj)

    def _whole(self, obj: dict[str, Any]) -> None:
        _take_chat_chunk(self, obj)
        choice = first_choice(obj)
        if choice is not None:
            self._text(choice.get("text"))


def _take_chat_chunk(capture: ReplyCapture, obj: Mapping[str, Any]) -> None:
    """What chat and completions chunks share: an error, usage."""
    if stream_error(obj) is not None:
        capture.errored = True
    usage = obj.get("usage")
    if isinstance(usage, dict):
        capture._take_usage(chat_usage(usage))
