"""The oracle: the prefix-cache hits a perfect router with unlimited cache would get.

It keeps every block any earlier request put in a cache anywhere: a request's prompt
blocks once it is sent, and its prompt + reply blocks once its reply is complete. A new
prompt then hits on its longest prefix of known blocks. Block hashes are chained (each
names its whole prefix), so the known set is prefix-closed and the walk stops at the
first miss.

Hits are whole blocks and leave at least the last prompt token to compute, as vLLM's
prefix cache does (it must run the model on one token to sample the next): the hit is
the longest known prefix of whole blocks within ``prompt_tokens - 1`` tokens.
"""

from __future__ import annotations

from bench.tokenizer import num_tokens
from router.wire.blocks import DEFAULT_BLOCK_TOKENS, TOKEN_BYTES, token_block_hashes


class PrefixOracle:
    __slots__ = ("_block_tokens", "_known")

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self._block_tokens = block_tokens
        self._known: set[int] = set()

    def __len__(self) -> int:
        return len(self._known)

    def hit_tokens(self, prompt: bytes) -> int:
        """Cached tokens the tokenized ``prompt`` would find (call before observing it)."""
        usable_blocks = max(num_tokens(prompt) - 1, 0) // self._block_tokens
        hits = 0
        usable = prompt[: usable_blocks * self._block_tokens * TOKEN_BYTES]
        for block_hash in token_block_hashes(usable, self._block_tokens):
            if block_hash not in self._known:
                break
            hits += 1
        return hits * self._block_tokens

    def observe_prompt(self, prompt: bytes) -> None:
        """A request was sent: its prompt's blocks are now cached somewhere."""
        self._known.update(token_block_hashes(prompt, self._block_tokens))

    def observe_completion(self, prompt: bytes, reply: bytes) -> None:
        """A request finished: the reply's tokens extend its prompt's cached blocks.

        ``reply`` is the generated tokens (for the simulator's tokenizer, the reply text
        encoded as one template piece). Like vLLM, the last generated token never had
        its KV computed, so it does not complete a block.
        """
        computed = (prompt + reply)[:-TOKEN_BYTES] if reply else prompt
        self._known.update(token_block_hashes(computed, self._block_tokens))
