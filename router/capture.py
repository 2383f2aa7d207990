"""Reads a response as it passes through: the reply text and the engine's usage.

The reply feeds a ``ChainExtender`` (so the next turn matches its whole history) and is
never kept whole; usage gives the engine-reported cached tokens. Capture is best effort:
a line that does not parse, or one longer than ``MAX_LINE_BYTES``, stops capturing and
never affects what the client receives.
"""

from __future__ import annotations

from typing import Any

import orjson

from router.prefix import ChainExtender

MAX_LINE_BYTES = 1 << 20


class ReplyCapture:
    __slots__ = ("_chat", "_extender", "_partial", "broken", "errored", "usage")

    def __init__(self, extender: ChainExtender | None, chat: bool) -> None:
        self._extender = extender
        self._chat = chat
        self._partial = bytearray()
        self.usage: dict[str, Any] | None = None
        self.errored = False  # the stream carried an error event
        self.broken = False  # capture gave up; the reply is incomplete

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
                if payload and payload != b"[DONE]":
                    self._event(payload)

    def feed_whole(self, body: bytes) -> None:
        """A complete (non-streaming) JSON response."""
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            self._give_up()
            return
        if isinstance(obj, dict):
            self._take(obj, whole=True)

    def _event(self, payload: bytes | bytearray) -> None:
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self._give_up()
            return
        if isinstance(obj, dict):
            self._take(obj, whole=False)

    def _take(self, obj: dict[str, Any], whole: bool) -> None:
        if "error" in obj:
            self.errored = True
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        if self._chat:
            part = choice.get("message" if whole else "delta")
            text = part.get("content") if isinstance(part, dict) else None
            if isinstance(part, dict) and part.get("tool_calls"):
                self._give_up()  # tool-call replies are not reconstructed
                return
        else:
            text = choice.get("text")
        if isinstance(text, str) and self._extender is not None:
            self._extender.feed(text)

    def _give_up(self) -> None:
        self.broken = True
        self._partial = bytearray()

    def reply_hashes(self) -> list[int]:
        """Hashes the reply adds to the chain; empty if the reply is unusable."""
        if self._extender is None or self.broken or self.errored:
            return []
        return self._extender.finish()

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details")
        value = details.get("cached_tokens") if isinstance(details, dict) else None
        return value if isinstance(value, int) else None

    @property
    def completion_tokens(self) -> int:
        value = (self.usage or {}).get("completion_tokens")
        return value if isinstance(value, int) else 0

    @property
    def prompt_tokens(self) -> int | None:
        value = (self.usage or {}).get("prompt_tokens")
        return value if isinstance(value, int) else None
