"""``router.tokens.reply``: a reply's blocks in token mode, from its text's tokens."""

from __future__ import annotations

from router.index.prefix import ChainExtender, prefix_key
from router.tokens.reply import MAX_REPLY_CHARS, TokenReplyChain
from router.wire.blocks import token_bytes

BLOCK_BYTES = 16  # 4 tokens


async def encode(text: str) -> bytes:
    """One token a character, its code point."""
    return token_bytes([ord(c) for c in text])


async def test_the_reply_continues_the_prompts_chain_by_its_tokens() -> None:
    key = prefix_key(token_bytes(range(10)), BLOCK_BYTES, seed=7)
    chain = TokenReplyChain(key, BLOCK_BYTES, encode)
    for part in ("hel", "lo wor", "ld"):
        chain.feed(part)
    assert chain.finish() == []  # nothing before the reply is complete
    await chain.settle()
    whole = prefix_key(token_bytes([*range(10), *map(ord, "hello world")]), BLOCK_BYTES, seed=7)
    assert key.hashes + tuple(chain.finish()) == whole.hashes
    assert len(chain.finish()) == 3  # (10 + 11) // 4 - 10 // 4


async def test_a_tool_call_stops_it_at_the_text_before() -> None:
    key = prefix_key(token_bytes(range(10)), BLOCK_BYTES, seed=7)
    chain = TokenReplyChain(key, BLOCK_BYTES, encode)
    chain.feed("abcdef")
    chain.feed_bytes(b'{"name": "run"}')
    chain.feed("more text that never counts")
    await chain.settle()
    expected = ChainExtender(key, BLOCK_BYTES, header=b"")
    expected.feed_bytes(await encode("abcdef"))
    assert chain.finish() == expected.finish() != []


async def test_a_reply_past_the_bound_adds_nothing() -> None:
    key = prefix_key(token_bytes(range(10)), BLOCK_BYTES, seed=7)
    chain = TokenReplyChain(key, BLOCK_BYTES, encode)
    chain.feed("x" * (MAX_REPLY_CHARS // 2))
    chain.feed("y" * (MAX_REPLY_CHARS // 2 + 1))
    await chain.settle()
    assert chain.finish() == []
