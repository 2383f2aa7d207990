"""Encoding a long conversation's prompt without re-encoding all of it every turn.

A session's turn N+1 renders to turn N's text with the reply and the new message
appended, so the ids of that shared text can be kept and only the rest encoded. Where
the cut is matters: a byte-level BPE merges across any ordinary character, but an added
token (``<|im_start|>``, ``<|im_end|>``) is cut out before the tokenizer's regex and
merges run, so the text on either side of one encodes on its own. Cuts are therefore
made only right after such a token (``ModelTokenizer.boundaries``), and only for
tokenizers that treat the start of a text like any other place (no "first" prefix
space); anything else is encoded whole.

Kept: for each prompt encoded, its ids and, at its last few cuts, a digest of the text
up to the cut. A prompt looks up the digests of its own cuts (one pass of xxh3 over the
text) from the last backwards; the longest found gives the ids to reuse. Nothing is
keyed by session: two sessions that share a system prompt share its cut too. What is
held is bounded (least recently used dropped first), so the cache never grows without
end: each prompt is charged its ids and, for its digests and arrays, as many again as
``PROMPT_OVERHEAD_TOKENS`` (short prompts cost more in bookkeeping than in ids).

A template that rewrites earlier turns (Qwen3 drops old reasoning, for one) renders a
text that no longer starts with the cut's text: its digest is not found and the prompt
is encoded from the last cut that still matches, or whole.
"""

from __future__ import annotations

import bisect
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from router.tokens.model import ModelTokenizer

# Cuts remembered per prompt, counted back from its end: the last one is often past
# where the next turn diverges (a generation prompt, a thinking block), the ones before
# it are not.
CUTS_KEPT = 4
DEFAULT_MAX_TOKENS = 16_000_000  # ids charged, ~64 MB
# What a held prompt's digests, arrays and entries cost beyond its ids (~0.8 KiB,
# measured), in ids of 4 bytes.
PROMPT_OVERHEAD_TOKENS = 256


@dataclass(frozen=True, slots=True)
class Encoded:
    ids: array[int]  # the prompt's ids, typecode "I"
    reused: int  # of them, taken from an earlier prompt without encoding
    start: int  # where in the text the encoding began (the end of the reused ids' text)
    ends: list[int]  # each newly encoded token's end, in characters from ``start``


class IncrementalEncoder:
    def __init__(self, model: ModelTokenizer, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self._pattern = None if model.start_sensitive else model.boundary_pattern()
        # digest of the text up to a cut -> (ids of some prompt, how many are the cut's)
        self._cuts: OrderedDict[int, tuple[array[int], int]] = OrderedDict()
        # every ids array the cuts point into, by id(), with its cuts' digests; each
        # charged once against max_tokens
        self._held: OrderedDict[int, tuple[array[int], list[int]]] = OrderedDict()
        self._charged_tokens = 0

    @property
    def charged_tokens(self) -> int:
        """The held prompts' ids, each prompt with its ``PROMPT_OVERHEAD_TOKENS``."""
        return self._charged_tokens

    @property
    def held_prompts(self) -> int:
        return len(self._held)

    def encode(self, text: str) -> Encoded:
        if self._pattern is None:
            whole = self.model.encoding(text)
            return Encoded(array("I", whole.ids), 0, 0, [end for _, end in whole.offsets])
        cuts = [match.end() for match in self._pattern.finditer(text)]
        digests = _digests(text, cuts)
        start, prefix = 0, array("I")
        for cut, digest in zip(reversed(cuts), reversed(digests), strict=True):
            found = self._cuts.get(digest)
            if found is not None:
                ids, length = found
                self._cuts.move_to_end(digest)
                self._held.move_to_end(id(ids))
                start, prefix = cut, ids[:length]
                break
        encoding = self.model.encoding(text[start:])
        reused = len(prefix)
        ids = prefix
        ids.extend(encoding.ids)
        ends = [end for _, end in encoding.offsets]
        self._remember(ids, reused, start, cuts, digests, ends)
        return Encoded(ids, reused, start, ends)

    def _remember(
        self,
        ids: array[int],
        reused: int,
        start: int,
        cuts: list[int],
        digests: list[int],
        ends: list[int],
    ) -> None:
        """Keep ``ids`` for the last cuts of the text; ``ends``: each newly encoded
        token's end, in characters from ``start``."""
        kept: list[int] = []
        for cut, digest in zip(reversed(cuts), reversed(digests), strict=True):
            if len(kept) == CUTS_KEPT or cut <= start:
                break
            # The cut follows a whole added token: some token ends exactly there.
            at = bisect.bisect_right(ends, cut - start)
            if at == 0 or ends[at - 1] != cut - start:
                continue  # the tokenizer did not cut here after all: not a safe place
            self._cuts[digest] = (ids, reused + at)
            self._cuts.move_to_end(digest)
            kept.append(digest)
        if kept:
            self._held[id(ids)] = (ids, kept)
            self._charged_tokens += len(ids) + PROMPT_OVERHEAD_TOKENS
            self._trim()

    def _trim(self) -> None:
        while self._charged_tokens > self.max_tokens and len(self._held) > 1:
            _, (dropped, digests) = self._held.popitem(last=False)
            self._charged_tokens -= len(dropped) + PROMPT_OVERHEAD_TOKENS
            for digest in digests:
                found = self._cuts.get(digest)
                if found is not None and found[0] is dropped:
                    del self._cuts[digest]


def _digests(text: str, cuts: list[int]) -> list[int]:
    """xxh3-64 of ``text[:cut]`` for each cut, in one pass."""
    state = xxhash.xxh3_64()
    digests = []
    previous = 0
    for cut in cuts:
        state.update(text[previous:cut].encode("utf-8", "surrogatepass"))
        digests.append(state.intdigest())
        previous = cut
    return digests
