"""What the simulated engine's block pool did, as vLLM's KV events.

vLLM announces a block when it is cached (``BlockStored``: one event per contiguous run
of a request's newly cached blocks, with the parent's hash and the run's tokens), a
block's removal when it is evicted for reuse (``BlockRemoved``), and ``AllBlocksCleared``
on a reset; the scheduler publishes what a step produced when the step ends. The pool
keys blocks by the simulator's own chained hashes (``bench/block_hash.py``); the events
carry vLLM's (``bench/sim/vllm_hash.py``), computed only for blocks first cached here and
remembered while they stay cached.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from bench.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from bench.sim.request import SimRequest
from bench.sim.tokenize import token_ids
from bench.sim.vllm_hash import BlockHasher, block_extra_keys, event_extra_keys, external_hash
from router.wire.blocks import TOKEN_BYTES

MEDIUM = "GPU"
GROUP = 0  # one full-attention KV cache group


def fresh_runs(first: int, fresh: Sequence[bool]) -> Iterator[tuple[int, int]]:
    """The ``[start, end)`` block ranges, from block ``first`` on, that ``fresh`` marks:
    each contiguous run of a request's newly cached blocks is announced as one event."""
    start = None
    for offset in range(len(fresh) + 1):
        if offset < len(fresh) and fresh[offset]:
            if start is None:
                start = first + offset
            continue
        if start is not None:
            yield start, first + offset
            start = None


class BatchSink(Protocol):
    def publish(self, batch: KVEventBatch) -> None: ...


class EventLog(Protocol):
    """What the scheduler tells of its pool: ``EngineEvents`` (vLLM's events) or
    ``sglang_kv_event_log.SglangEngineEvents``."""

    def stored(self, request: SimRequest, first: int, fresh: Sequence[bool]) -> None: ...
    def removed(self, pool_hash: int) -> None: ...
    def cleared(self) -> None: ...
    def flush(self) -> None: ...


class EngineEvents:
    def __init__(
        self, sink: BatchSink, hasher: BlockHasher, block_tokens: int, int_hashes: bool = False
    ) -> None:
        self.sink = sink
        self.hasher = hasher
        self.block_tokens = block_tokens
        self.int_hashes = int_hashes
        self._names: dict[int, bytes] = {}  # a cached block's pool hash -> its vLLM hash
        self._pending: list[Any] = []

    def stored(self, request: SimRequest, first: int, fresh: Sequence[bool]) -> None:
        """Blocks ``first ..`` of ``request`` were just cached; ``fresh[i]`` says whether
        block ``first + i`` was cached by this request (not already held)."""
        upto = first + len(fresh)
        names = self._engine_hashes(request, upto)
        for start, end in fresh_runs(first, fresh):
            self._store_run(request, names, start, end)

    def removed(self, pool_hash: int) -> None:
        name = self._names.pop(pool_hash, None)
        if name is not None:
            self._pending.append(
                BlockRemoved(block_hashes=[self._external(name)], medium=MEDIUM, group_idx=GROUP)
            )

    def cleared(self) -> None:
        self._names.clear()
        self._pending.append(AllBlocksCleared())

    def flush(self) -> None:
        """Publish what the step produced (vLLM: ``Scheduler.update_from_output``)."""
        if self._pending:
            self.sink.publish(KVEventBatch(ts=time.time(), events=self._pending))
            self._pending = []

    def _store_run(self, request: SimRequest, names: list[bytes], start: int, end: int) -> None:
        for i in range(start, end):
            self._names[request.hashes[i]] = names[i]
        self._pending.append(
            BlockStored(
                block_hashes=[self._external(names[i]) for i in range(start, end)],
                parent_block_hash=self._external(names[start - 1]) if start else None,
                token_ids=self._token_ids(request, start, end),
                block_size=self.block_tokens,
                lora_id=None,
                medium=MEDIUM,
                lora_name=None,
                extra_keys=[
                    event_extra_keys(block_extra_keys(i, request.cache_salt))
                    for i in range(start, end)
                ],
                group_idx=GROUP,
            )
        )

    def _engine_hashes(self, request: SimRequest, upto: int) -> list[bytes]:
        names = request.engine_hashes
        hasher, known = self.hasher, self._names
        for i in range(len(names), upto):
            name = known.get(request.hashes[i])
            if name is None:
                name = hasher.block(
                    names[i - 1] if i else None,
                    self._token_ids(request, i, i + 1),
                    block_extra_keys(i, request.cache_salt),
                )
            names.append(name)
        return names

    def _token_ids(self, request: SimRequest, start: int, end: int) -> list[int]:
        step = self.block_tokens * TOKEN_BYTES
        prompt, lo, hi = request.prompt, start * step, end * step
        return token_ids(prompt[lo:hi] if hi <= len(prompt) else request.tokens[lo:hi])

    def _external(self, name: bytes) -> bytes | int:
        return external_hash(name, self.int_hashes)
