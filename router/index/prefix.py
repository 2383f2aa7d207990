"""Prefix keys: the canonical bytes of a request, cut into blocks and hashed in a chain.

The canonical form is what the engine will cache, up to tokenization: for chat, the
messages in order, each rendered as ``RS role US content [US tool_calls]``; for
completions, the prompt text (or its token ids). Appending a message only appends bytes,
so every turn of a session extends the previous turn's chain.

Blocks are ``block_bytes`` long and chained: ``h_i = xxh3_64(block_i, seed=h_{i-1})``,
``h_{-1} = xxh3_64(model NUL cache_salt)``. The model name covers LoRA adapters, which
vLLM serves under their own model names. Only full blocks are hashed; the partial tail is
kept so the streamed reply can extend the chain (``ChainExtender``).
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from router.wire.blocks import chain_hashes, token_bytes

_RS = b"\x1e"  # starts a message
_US = b"\x1f"  # separates its fields
_TOKEN_IDS = b"\x1d"  # marks a prompt given as token ids

_digest = xxhash.xxh3_64_intdigest


def chain_seed(model: str, cache_salt: str | None = None) -> int:
    return _digest(f"{model}\x00{cache_salt or ''}".encode())


def content_text(content: Any) -> str:
    """OpenAI message content (a string or a list of parts) as text; non-text parts
    render as their sorted JSON, so the same part always gives the same bytes."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        else:
            parts.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
    return "".join(parts)


def render_message(message: Mapping[str, Any]) -> bytes:
    pieces = [
        _RS,
        str(message.get("role", "")).encode(),
        _US,
        content_text(message.get("content")).encode(),
    ]
    tool_calls = message.get("tool_calls")
    if tool_calls:
        pieces.append(render_tool_calls(tool_calls))
    return b"".join(pieces)


def render_tool_calls(tool_calls: Sequence[Mapping[str, Any]]) -> bytes:
    """An assistant message's ``tool_calls`` as they follow its content."""
    return _US + orjson.dumps(tool_calls, option=orjson.OPT_SORT_KEYS)


def render_chat_history(messages: Sequence[Mapping[str, Any]]) -> tuple[bytes, int]:
    """The canonical bytes, and how many of them an earlier turn of the same session
    would have left in some engine's cache: everything before the last assistant message
    (that turn's prompt), or before the last message in a session's first turn."""
    rendered = [render_message(m) for m in messages]
    last = len(messages) - 1
    for i in range(last, -1, -1):
        if messages[i].get("role") == "assistant":
            last = i
            break
    return b"".join(rendered), sum(map(len, rendered[:last]))


def render_prompt(prompt: str | Sequence[int]) -> bytes:
    if isinstance(prompt, str):
        return prompt.encode()
    return _TOKEN_IDS + token_bytes(prompt)


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """The chained block hashes of a request and what is needed to extend them."""

    hashes: tuple[int, ...]
    tail: bytes  # canonical bytes after the last full block
    seed: int
    total_bytes: int

    @property
    def last_hash(self) -> int:
        return self.hashes[-1] if self.hashes else self.seed


def leading_held(hashes: Sequence[int], held: Container[int], reserved: Container[int]) -> int:
    """How many leading ``hashes`` are in ``held`` or ``reserved``, by binary search: a
    worker's holdings are (nearly) prefix-closed, so O(log n) lookups find the longest."""
    if not hashes or (hashes[0] not in held and hashes[0] not in reserved):
        return 0
    low, high = 1, len(hashes)  # hashes[:low] held; find the largest such low
    while low < high:
        mid = (low + high + 1) // 2
        h = hashes[mid - 1]
        if h in held or h in reserved:
            low = mid
        else:
            high = mid - 1
    return low


def prefix_key(canonical: bytes, block_bytes: int, seed: int) -> PrefixKey:
    hashes = chain_hashes(canonical, block_bytes, seed)
    tail = canonical[len(hashes) * block_bytes :]
    return PrefixKey(tuple(hashes), tail, seed, len(canonical))


def extended_key(key: PrefixKey, data: bytes, block_bytes: int) -> PrefixKey:
    """The key of ``key``'s canonical bytes followed by ``data``: what ``prefix_key``
    gives for the whole, without the bytes before the tail."""
    pending = key.tail + data
    hashes = chain_hashes(pending, block_bytes, key.last_hash)
    tail = pending[len(hashes) * block_bytes :]
    return PrefixKey((*key.hashes, *hashes), tail, key.seed, key.total_bytes + len(data))


# A chat reply comes back as the next turn's {"role": "assistant", "content": reply}.
CHAT_REPLY_HEADER = _RS + b"assistant" + _US
# A completion's next prompt continues the text directly.
COMPLETION_REPLY_HEADER = b""


class ChainExtender:
    """Extends a request's chain with the reply as the next turn will carry it.

    Fed the reply text as it streams; holds at most one block of bytes (the reply is never
    buffered whole). ``finish()`` returns the hashes of the full blocks that the prompt
    plus ``header + reply`` adds beyond the prompt's own; ``key()`` the key of the
    prompt and what was fed so far.
    """

    __slots__ = ("_block_bytes", "_buffer", "_fed", "_hashes", "_key", "_parent")

    def __init__(self, key: PrefixKey, block_bytes: int, header: bytes = CHAT_REPLY_HEADER) -> None:
        self._key = key
        self._block_bytes = block_bytes
        self._parent = key.last_hash
        self._buffer = bytearray(key.tail)
        self._buffer += header
        self._fed = len(header)  # bytes after the prompt's
        self._hashes: list[int] = []
        self._drain()

    def feed(self, text: str) -> None:
        if text:
            self.feed_bytes(text.encode())

    def feed_bytes(self, data: bytes) -> None:
        if data:
            self._buffer += data
            self._fed += len(data)
            self._drain()

    def _drain(self) -> None:
        size = self._block_bytes
        if len(self._buffer) < size:
            return
        full = len(self._buffer) // size * size
        block_hashes = chain_hashes(bytes(self._buffer[:full]), size, self._parent)
        self._hashes += block_hashes
        self._parent = block_hashes[-1]
        del self._buffer[:full]

    async def settle(self) -> None:
        """Nothing to wait for: the text is hashed as it arrives."""

    def finish(self) -> list[int]:
        return self._hashes

    def key(self) -> PrefixKey:
        """The prompt's key extended by the header and everything fed since."""
        prompt = self._key
        total = prompt.total_bytes + self._fed
        return PrefixKey((*prompt.hashes, *self._hashes), bytes(self._buffer), prompt.seed, total)

    def unreplied_key(self) -> PrefixKey:
        """The prompt's own key: the conversation where the reply adds no message."""
        return self._key
