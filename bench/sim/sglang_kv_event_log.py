"""What the simulated engine's block pool did, as SGLang 0.5.23's KV events
(``sglang/srt/mem_cache/events.py``, ``KVCacheEventRecorder``).

SGLang announces the pages a radix-tree insert adds (``record_store``: one
``BlockStored`` per page, the parent the previous page, the first page's parent nil
under the root) and coalesces each event into the queue's tail when it continues it
(``enqueue``: same medium, salt, LoRA and block size, parent = the tail's last hash), so
a request's newly cached run goes out as one event; consecutive removals coalesce the
same way. The pool's runs of newly cached blocks are those inserts, each evicted block a
removal, a reset ``AllBlocksCleared`` (and so does a new process's first batch); a
step's events go out together when it ends.

The hashes are SGLang's (``sglang_kv_events.page_digest``), computed only for blocks
first cached here and remembered while they stay cached.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from bench.sim.kv_event_log import StoredBlock, fresh_runs
from bench.sim.request import SimRequest
from bench.sim.sglang_kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Format,
    KVEventBatch,
    event_hash,
    namespace_seed,
    namespaced_block_hash,
    page_digest,
    salt_seed,
)
from bench.sim.tokenize import token_ids
from router.wire.blocks import TOKEN_BYTES

MEDIUM = "GPU"  # StorageMedium.GPU


class BatchSink(Protocol):
    def publish(self, batch: KVEventBatch) -> None: ...


class SglangEngineEvents:
    """``kv_event_log.EventLog`` in SGLang's events; ``page_tokens`` is the page size."""

    def __init__(self, sink: BatchSink, page_tokens: int, format: Format = "default") -> None:
        self.sink = sink
        self.page_tokens = page_tokens
        self.format = format
        # A cached block's pool hash -> its SGLang page digest and the hash published.
        self._names: dict[int, tuple[bytes, int]] = {}
        # SGLang's cache resets itself when built (UnifiedRadixCache.__init__ -> reset ->
        # record_all_cleared), so a new process's first batch opens with AllBlocksCleared;
        # here it goes out with the first step's events (SGLang's, on its first idle loop).
        self._pending: list[BlockStored | BlockRemoved | AllBlocksCleared] = [AllBlocksCleared()]

    def stored(self, request: SimRequest, first: int, fresh: Sequence[bool]) -> None:
        """Blocks ``first ..`` of ``request`` were just cached; ``fresh[i]`` says whether
        block ``first + i`` was cached by this request (not already held)."""
        digests = self._digests(request, first + len(fresh))
        for start, end in fresh_runs(first, fresh):
            self._store_run(request, digests, start, end)

    def removed(self, pool_hash: int) -> None:
        name = self._names.pop(pool_hash, None)
        if name is not None:
            self._enqueue(BlockRemoved(block_hashes=[name[1]], medium=MEDIUM))

    def offload_stored(self, request: SimRequest, first: int, fresh: Sequence[bool]) -> None:
        """Never called: an SGLang-flavoured engine has no offload tier (``EngineConfig``)."""

    def offload_removed(self, pool_hash: int) -> None:
        """Never called, as ``offload_stored``."""

    def idle(self) -> None:
        """Nothing is ever in flight here."""

    def window_stored(
        self, request: SimRequest, first: int, kept: Sequence[int], group: int
    ) -> None:
        """Never called: an SGLang-flavoured engine has no window groups (``EngineConfig``)."""

    def window_removed(self, group: int, pool_hash: int) -> None:
        """Never called, as ``window_stored``."""

    def cleared(self) -> None:
        self._names.clear()
        self._pending.append(AllBlocksCleared())

    def described(self, pool_hash: int) -> StoredBlock | None:
        """Nothing: a restored SGLang-flavoured engine announces only ``AllBlocksCleared``
        (its pages' tokens are not kept; see ``bench/sim/checkpoint.py``)."""
        return None

    def restored(self, blocks: Sequence[tuple[int, StoredBlock | None]]) -> None:
        self.cleared()
        self.flush()

    def flush(self) -> None:
        """Publish what the step produced (SGLang: ``publish_kv_events``, whose batch
        the publisher stamps with its ``attn_dp_rank``)."""
        if self._pending:
            self.sink.publish(KVEventBatch(ts=time.time(), events=self._pending))
            self._pending = []

    def _store_run(self, request: SimRequest, digests: list[bytes], start: int, end: int) -> None:
        seed = self._seed(request)
        published = [namespaced_block_hash(event_hash(d), seed) for d in digests[start:end]]
        for i, block_hash in zip(range(start, end), published, strict=True):
            self._names[request.hashes[i]] = (digests[i], block_hash)
        parent = namespaced_block_hash(event_hash(digests[start - 1]), seed) if start else None
        self._enqueue(
            BlockStored(
                block_hashes=published,
                parent_block_hash=parent,
                token_ids=token_ids(self._page_bytes(request, start, end)),
                block_size=self.page_tokens,
                lora_id=None,
                medium=MEDIUM,
                cache_salt=request.cache_salt,
            )
        )

    def _enqueue(self, event: BlockStored | BlockRemoved) -> None:
        """SGLang's ``KVCacheEventRecorder.enqueue``: extend the tail when it continues."""
        tail = self._pending[-1] if self._pending else None
        if isinstance(tail, BlockRemoved) and isinstance(event, BlockRemoved):
            if tail.medium == event.medium:
                tail.block_hashes.extend(event.block_hashes)
                return
        elif (
            isinstance(tail, BlockStored)
            and isinstance(event, BlockStored)
            and _continues(tail, event)
        ):
            tail.block_hashes.extend(event.block_hashes)
            tail.token_ids.extend(event.token_ids)
            return
        self._pending.append(event)

    def _seed(self, request: SimRequest) -> bytes | None:
        # The default format namespaces only LoRA adapters' blocks, which the simulator
        # has none of; dynamo's namespaces salted ones too (extra_key is None: no LoRA).
        if self.format == "dynamo":
            return namespace_seed(None, request.cache_salt)
        return None

    def _digests(self, request: SimRequest, upto: int) -> list[bytes]:
        """The page digests of ``request``'s blocks ``0 .. upto``, kept on the request
        (``engine_hashes``) and taken from the blocks already named where they are."""
        digests = request.engine_hashes
        known = self._names
        for i in range(len(digests), upto):
            name = known.get(request.hashes[i])
            if name is not None:
                digests.append(name[0])
                continue
            parent = digests[i - 1] if i else salt_seed(request.cache_salt)
            digests.append(page_digest(parent, self._page_bytes(request, i, i + 1)))
        return digests

    def _page_bytes(self, request: SimRequest, start: int, end: int) -> bytes:
        step = self.page_tokens * TOKEN_BYTES
        prompt, lo, hi = request.prompt, start * step, end * step
        return prompt[lo:hi] if hi <= len(prompt) else request.tokens[lo:hi]


def _continues(tail: BlockStored, event: BlockStored) -> bool:
    """``event`` extends ``tail``'s chain with the same attributes."""
    same = (tail.medium, tail.lora_id, tail.block_size, tail.cache_salt) == (
        event.medium,
        event.lora_id,
        event.block_size,
        event.cache_salt,
    ) and (tail.session_id, tail.lora_name) == (event.session_id, event.lora_name)
    return same and bool(tail.block_hashes) and event.parent_block_hash == tail.block_hashes[-1]
