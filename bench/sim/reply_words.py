"""What a simulated engine generates: words drawn at random, each one token, kept as 4
bytes a token like a prompt (``bench/sim/prompts.py``).

The stand-in's words are 4 ASCII characters whose bytes are the token. With a model's
tokenizer the words are tokens of its vocabulary, a space and a few lowercase letters,
each of which the tokenizer encodes back to itself alone; so the generated ids are real
ids (in KV events and ``/detokenize``), and the reply's text, sent back in the next turn,
encodes to the ids the engine cached, as natural text mostly does with a real model.
"""

from __future__ import annotations

import random
import re
from typing import Protocol

from bench.textgen import generated_text
from router.tokens.model import ModelTokenizer
from router.wire.blocks import TOKEN_BYTES

# How many of the vocabulary's words a model's replies draw from.
MODEL_WORDS = 512
# A byte-level BPE's spelling of " word": "Ġ" stands for the leading space.
_WORD_TOKEN = re.compile(r"Ġ[a-z]{3,7}")


class ReplyWords(Protocol):
    def draw(self, rng: random.Random, tokens: int) -> bytes:
        """``tokens`` fresh tokens, 4 bytes each."""

    def text(self, tokens: bytes) -> str:
        """The text of tokens this drew."""


class StandInWords:
    __slots__ = ()

    def draw(self, rng: random.Random, tokens: int) -> bytes:
        return generated_text(rng, tokens).encode("ascii")

    def text(self, tokens: bytes) -> str:
        return tokens.decode("ascii")


STAND_IN_WORDS = StandInWords()


class ModelWords:
    """Words of a model's vocabulary that encode back to themselves, one token each."""

    __slots__ = ("_text_of", "_tokens")

    def __init__(self, words: dict[int, str]) -> None:
        if not words:
            raise ValueError("a model's reply words: none found in its vocabulary")
        self._tokens = [i.to_bytes(TOKEN_BYTES, "little") for i in sorted(words)]
        self._text_of = {i.to_bytes(TOKEN_BYTES, "little"): w for i, w in words.items()}

    @classmethod
    def of(cls, model: ModelTokenizer, count: int = MODEL_WORDS) -> ModelWords:
        tokenizer = model.tokenizer
        candidates = sorted(
            (i, token)
            for token, i in tokenizer.get_vocab(with_added_tokens=False).items()
            if _WORD_TOKEN.fullmatch(token)
        )
        words: dict[int, str] = {}
        for i, token in candidates:
            word = " " + token[1:]
            if tokenizer.encode(word, add_special_tokens=False).ids == [i]:
                words[i] = word
                if len(words) == count:
                    break
        return cls(words)

    def draw(self, rng: random.Random, tokens: int) -> bytes:
        return b"".join(rng.choices(self._tokens, k=tokens))

    def text(self, tokens: bytes) -> str:
        text_of = self._text_of
        return "".join(text_of[tokens[i : i + TOKEN_BYTES]] for i in range(0, len(tokens), 4))
