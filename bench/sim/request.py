"""One request inside the simulated engine."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from enum import Enum

from bench.sim.reply_words import STAND_IN_WORDS, ReplyWords
from bench.sim.request_log import RequestRecord
from router.wire.blocks import TOKEN_BYTES, token_block_hashes

# Most output tokens sampled ahead of need (``SimRequest._draw_ahead``).
DRAW_AHEAD_TOKENS = 512


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# The members as plain names for the per-step checks: an attribute of an Enum class
# takes ~15x longer to look up than a global.
WAITING, RUNNING, FINISHED = Status.WAITING, Status.RUNNING, Status.FINISHED


class SimRequest:
    """Token state, timing and the signal a handler waits on.

    The tokens are the prompt (whole tokens, 4 bytes each) followed by every generated
    token (``output``); they are kept apart so that generating never copies the prompt.
    ``num_computed`` of them have KV in ``blocks``. ``hashes`` covers their full blocks
    and grows as output is generated.
    """

    __slots__ = (
        "_drawn",
        "_drawn_at",
        "arrival",
        "blocks",
        "cache_salt",
        "cached_tokens",
        "end_reason",
        "engine_hashes",
        "finish_reason",
        "finished_at",
        "first_token_at",
        "hashes",
        "id",
        "listener",
        "loaded_from",
        "loaded_tokens",
        "loading_until",
        "max_output",
        "max_tokens",
        "num_computed",
        "num_preemptions",
        "output",
        "output_tokens",
        "prompt",
        "prompt_tokens",
        "published_tokens",
        "record",
        "rng",
        "scheduled_at",
        "status",
        "token_times",
        "updated",
        "window_junction",
        "words",
    )

    def __init__(
        self,
        request_id: str,
        prompt: bytes,
        max_output: int,
        arrival: float,
        block_tokens: int,
        rng: random.Random,
        parent_hash: int = 0,
        end_reason: str = "length",
        hashes: list[int] | None = None,
        cache_salt: str | None = None,
        words: ReplyWords = STAND_IN_WORDS,
    ) -> None:
        self.id = request_id
        self.words = words  # what it generates
        self.prompt = prompt
        self.output = bytearray()
        self.prompt_tokens = len(prompt) // TOKEN_BYTES
        self.max_output = max_output
        # The client's max_tokens (the engine sets it when the reply may end sooner).
        self.max_tokens = max_output
        # Why generation stops at max_output: "length" (max_tokens) or "stop" (an EOS).
        self.end_reason = end_reason
        self.arrival = arrival
        self.rng = rng
        # ``hashes``, when given, must be ``chain_hashes`` of the prompt (``PrefixHashes``).
        self.hashes = (
            token_block_hashes(prompt, block_tokens, parent_hash) if hashes is None else hashes
        )
        self.cache_salt = cache_salt
        # vLLM's hashes of the full blocks, computed only when KV events are published.
        self.engine_hashes: list[bytes] = []
        self.blocks: list[int] = []
        self.num_computed = 0
        self.output_tokens = 0
        self.published_tokens = 0  # output tokens the handler was last woken for
        self.cached_tokens = 0
        # While its prefix is read back from the offload tier: when that ends, and the
        # first block it loads (the blocks from there to ``num_computed`` are the load's).
        self.loading_until: float | None = None
        self.loaded_from = 0
        self.loaded_tokens = 0  # of ``cached_tokens``, read back from the offload tier
        # Where a hybrid model's full-attention hit ended, cut short by its window groups
        # (blocks; 0: not cut): they keep the window before it (bench/sim/windows.py).
        self.window_junction = 0
        self.num_preemptions = 0
        self.status = WAITING
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.finish_reason: str | None = None
        self.token_times: list[float] = []
        # Its cache facts for ``GET /sim/requests``, once the engine has taken it.
        self.record: RequestRecord | None = None
        self.updated = asyncio.Event()
        # Called with the request instead of setting ``updated`` while it streams; it
        # returns False to have ``updated`` set after all (see ``notify``).
        self.listener: Callable[[SimRequest], bool] | None = None
        # Tokens sampled ahead of the output (``_draw_ahead``), from ``_drawn_at`` on.
        self._drawn = b""
        self._drawn_at = 0

    @property
    def tokens(self) -> bytes:
        """The prompt and the output so far."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def cache_written_tokens(self, block_tokens: int) -> int:
        """The prompt's tokens this request wrote to the cache: its full blocks it did
        not find cached (vLLM's ``num_cache_creation_tokens``)."""
        return max(0, self.prompt_tokens // block_tokens * block_tokens - self.cached_tokens)

    @property
    def finished(self) -> bool:
        return self.status is FINISHED

    @property
    def dropped(self) -> bool:
        """The engine lost the request (a simulated restart): its connection ends
        abruptly rather than with an answer."""
        return self.status is FINISHED and self.finish_reason == "abort"

    async def next_update(self) -> None:
        """Wait for ``updated``, and take it down."""
        await self.updated.wait()
        self.updated.clear()

    def notify(self) -> None:
        """Tell the handler its request advanced: through the listener, which can act at
        once (a stream writes the new tokens), or else by setting ``updated``."""
        listener = self.listener
        if listener is None or not listener(self):
            self.updated.set()

    def append_generated(self, block_tokens: int, count: int = 1) -> None:
        """Append ``count`` sampled tokens and hash the blocks they fill."""
        size = count * TOKEN_BYTES
        if len(self._drawn) - self._drawn_at < size:
            self._draw_ahead(count)
        at = self._drawn_at
        self.output += self._drawn[at : at + size]
        self._drawn_at = at + size
        self.output_tokens += count
        step = block_tokens * TOKEN_BYTES
        start = len(self.hashes) * step  # the first block not hashed yet
        end = (len(self.prompt) + len(self.output)) // step * step
        if end > start:
            # The prompt's full blocks were hashed with it: a block still to hash starts
            # in the prompt's last, partial block or in the output.
            prompt_bytes = len(self.prompt)
            fresh: bytes | bytearray
            if start < prompt_bytes:
                fresh = self.prompt[start:] + self.output[: end - prompt_bytes]
            else:
                fresh = self.output[start - prompt_bytes : end - prompt_bytes]
            parent = self.hashes[-1] if self.hashes else 0
            self.hashes += token_block_hashes(fresh, block_tokens, parent)

    def _draw_ahead(self, count: int) -> None:
        """Sample at least ``count`` more tokens into ``_drawn``, up to ``DRAW_AHEAD_TOKENS``
        of the output still to come: one ``generated_text`` call per step would cost more
        than the tokens, and it takes one ``random()`` per token whatever the batch, so
        the text is the same as sampling each step's tokens on their own."""
        left = self._drawn[self._drawn_at :]
        ahead = max(count, min(DRAW_AHEAD_TOKENS, self.max_output - self.output_tokens))
        fresh = self.words.draw(self.rng, ahead - len(left) // TOKEN_BYTES)
        self._drawn, self._drawn_at = left + fresh, 0

    def output_text(self, start_token: int = 0) -> str:
        return self.words.text(bytes(self.output[start_token * TOKEN_BYTES :]))
