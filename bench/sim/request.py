"""One request inside the simulated engine."""

from __future__ import annotations

import asyncio
import random
from enum import Enum

from bench.block_hash import chain_hashes
from bench.textgen import generated_text
from bench.tokenizer import TOKEN_BYTES


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SimRequest:
    """Token state, timing and the signal a handler waits on.

    ``tokens`` is the prompt followed by every generated token (4 bytes each);
    ``num_computed`` of them have KV in ``blocks``. ``hashes`` covers the full blocks
    of ``tokens`` and grows as output is generated.
    """

    __slots__ = (
        "arrival", "blocks", "cached_tokens", "end_reason", "finish_reason", "finished_at",
        "first_token_at", "hashes", "id", "max_output", "num_computed", "num_preemptions",
        "output_tokens", "prompt_tokens", "published_tokens", "rng", "scheduled_at", "status",
        "token_times", "tokens", "updated",
    )

    def __init__(
        self, request_id: str, prompt: bytes, max_output: int, arrival: float,
        block_tokens: int, rng: random.Random, parent_hash: int = 0, end_reason: str = "length",
    ) -> None:
        self.id = request_id
        self.tokens = bytearray(prompt)
        self.prompt_tokens = len(prompt) // TOKEN_BYTES
        self.max_output = max_output
        # Why generation stops at max_output: "length" (max_tokens) or "stop" (an EOS).
        self.end_reason = end_reason
        self.arrival = arrival
        self.rng = rng
        self.hashes = chain_hashes(prompt, block_tokens, parent_hash)
        self.blocks: list[int] = []
        self.num_computed = 0
        self.output_tokens = 0
        self.published_tokens = 0  # output tokens the handler was last woken for
        self.cached_tokens = 0
        self.num_preemptions = 0
        self.status = Status.WAITING
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.finish_reason: str | None = None
        self.token_times: list[float] = []
        self.updated = asyncio.Event()

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_generated(self, block_tokens: int, count: int = 1) -> None:
        """Append ``count`` sampled tokens and hash the blocks they fill."""
        self.tokens += generated_text(self.rng, count).encode("ascii")
        self.output_tokens += count
        full = self.num_tokens // block_tokens
        if full > len(self.hashes):
            parent = self.hashes[-1] if self.hashes else 0
            self.hashes += chain_hashes(self.tokens, block_tokens, parent, len(self.hashes))

    def output_text(self, start_token: int = 0) -> str:
        begin = (self.prompt_tokens + start_token) * TOKEN_BYTES
        return self.tokens[begin:].decode("ascii")
