"""A chat reply's blocks when prompts are keyed by the model's tokens.

The engine cached the ids it generated; the next turn carries the reply's text, which the
template renders into that turn's prompt and the tokenizer encodes. Natural text mostly
encodes back to the ids that produced it, so the reply's blocks are the prompt's chain
continued by its text's ids. The text is only collected while it streams (bounded) and
encoded once the reply is complete, on the tokenizer's thread.

Tool calls are rendered by each model's template in its own way: the chain stops at the
reply's text before them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from router.index.prefix import ChainExtender, PrefixKey

# The most of a reply's text kept to encode; past it the reply adds nothing.
MAX_REPLY_CHARS = 1 << 20

Encode = Callable[[str], Awaitable[bytes | None]]


class TokenReplyChain:
    """``router.apis.capture.ReplyChain`` in the model's tokens."""

    __slots__ = ("_chain", "_closed", "_encode", "_known", "_parts", "_size")

    def __init__(self, key: PrefixKey, block_bytes: int, encode: Encode) -> None:
        # The prompt ends with the generation prompt: the reply's ids follow it directly.
        self._chain = ChainExtender(key, block_bytes, header=b"")
        self._encode = encode
        self._parts: list[str] = []
        self._size = 0
        self._closed = False  # no more text counts (too long, or a tool call came)
        self._known = True  # all of the text is in the chain (none left out, encoded)

    def feed(self, text: str) -> None:
        if self._closed or not text:
            return
        self._size += len(text)
        if self._size > MAX_REPLY_CHARS:
            self._closed, self._known, self._parts = True, False, []
            return
        self._parts.append(text)

    def feed_bytes(self, data: bytes) -> None:
        """Rendered tool calls: the template's own rendering is not known here."""
        self._closed = True

    async def settle(self) -> None:
        """Encodes the text collected; call once the reply is complete."""
        if not self._parts:
            return
        text, self._parts = "".join(self._parts), []
        ids = await self._encode(text)
        if ids:
            self._chain.feed_bytes(ids)
        else:
            self._known = False

    def finish(self) -> list[int]:
        return self._chain.finish()

    def key(self) -> PrefixKey | None:
        return self._chain.key() if self._known else None

    def unreplied_key(self) -> PrefixKey | None:
        """Unknown: the prompt's ids end with the generation prompt, which a conversation
        without the reply's message does not hold."""
        return None
