"""What the simulated engine's block pool did, as vLLM's KV events.

vLLM announces a block when it is cached (``BlockStored``: one event per contiguous run
of a request's newly cached blocks, with the parent's hash and the run's tokens), a
block's removal when it is evicted for reuse (``BlockRemoved``), and ``AllBlocksCleared``
on a reset; the scheduler publishes what a step produced when the step ends. The pool
keys blocks by the simulator's own chained hashes (``bench/block_hash.py``); the events
carry vLLM's (``bench/sim/vllm_hash.py``), computed only for blocks first cached here and
remembered while they stay cached.

A checkpoint (``bench/sim/checkpoint.py``) carries each cached block as a
:class:`StoredBlock`: its vLLM hash, its parent's and its tokens, what a ``BlockStored``
needs. A restored engine announces its cache as a new process that found it would:
``AllBlocksCleared``, then one ``BlockStored`` per block, parents before children.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import msgspec

from bench.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from bench.sim.request import SimRequest
from bench.sim.tokenize import token_ids
from bench.sim.vllm_hash import BlockHasher, block_extra_keys, event_extra_keys, external_hash
from router.wire.blocks import TOKEN_BYTES

MEDIUM = "GPU"
OFFLOAD_MEDIUM = "CPU"  # vLLM's native offloading connector's tier
GROUP = 0  # one full-attention KV cache group
SPEC_KIND = "full_attention"  # vLLM 0.32 names the group's kind
WINDOW_KIND = "sliding_window"  # a hybrid model's window groups' (bench/sim/windows.py)


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


class StoredBlock(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A cached block as its ``BlockStored`` told it: vLLM's hash, the parent's (None
    for a first block), the block's tokens (as the prompt's bytes) and the cache salt
    of a first block."""

    name: bytes
    parent: bytes | None
    tokens: bytes
    cache_salt: str | None = None


class BatchSink(Protocol):
    def publish(self, batch: KVEventBatch) -> None: ...


class EventLog(Protocol):
    """What the scheduler tells of its pool: ``EngineEvents`` (vLLM's events) or
    ``sglang_kv_event_log.SglangEngineEvents``."""

    def stored(self, request: SimRequest, first: int, fresh: Sequence[bool]) -> None: ...
    def removed(self, pool_hash: int) -> None: ...
    def offload_stored(self, request: SimRequest, first: int, fresh: Sequence[bool]) -> None: ...
    def offload_removed(self, pool_hash: int) -> None: ...
    def window_stored(
        self, request: SimRequest, first: int, kept: Sequence[int], group: int
    ) -> None: ...
    def window_removed(self, group: int, pool_hash: int) -> None: ...
    def idle(self) -> None: ...
    def cleared(self) -> None: ...
    def flush(self) -> None: ...
    def described(self, pool_hash: int) -> StoredBlock | None: ...
    def restored(self, blocks: Sequence[tuple[int, StoredBlock | None]]) -> None: ...


class EngineEvents:
    """vLLM's events for the GPU's cache and, with an offload tier, the CPU's, as vLLM
    0.32 orders them: a step's batch holds the block pool's events, then the offloading
    connector's: the CPU tier's evictions made to store that step's blocks (one
    ``BlockRemoved`` with all of them), then the stores the previous step started, now
    complete (one ``BlockStored`` a block). With ``self_describing`` (the connector's
    ``self_describing_kv_events``) a CPU store is announced as a GPU one is, with
    ``medium`` "CPU"; without, as its placeholder: the hash alone, no tokens,
    ``block_size`` 0. Stores still in flight when the engine falls idle go out then, as
    vLLM steps once more to complete them."""

    def __init__(
        self,
        sink: BatchSink,
        hasher: BlockHasher,
        block_tokens: int,
        int_hashes: bool = False,
        self_describing: bool = True,
        windows: tuple[int, int] | None = None,
    ) -> None:
        self.sink = sink
        self.hasher = hasher
        self.block_tokens = block_tokens
        self.int_hashes = int_hashes
        self.self_describing = self_describing
        # A hybrid model's (window tokens, window groups): groups 0 .. n-1 are the
        # window's, the full-attention group comes last (as vLLM numbers them).
        self.windows = windows
        self.group = windows[1] if windows is not None else GROUP
        self._windowed: list[Any] = []  # the window groups' stores, first in a batch
        self._window_names: dict[tuple[int, int], bytes] = {}  # (group, pool hash) -> name
        self._names: dict[int, bytes] = {}  # a cached block's pool hash -> its vLLM hash
        self._stored: dict[int, StoredBlock] = {}  # and what its BlockStored told
        self._offload_names: dict[int, bytes] = {}  # the same for the offload tier
        self._pending: list[Any] = []
        self._offload_evicted: list[bytes | int] = []  # this step's CPU evictions
        self._offload_storing: list[BlockStored] = []  # this step's CPU stores
        self._offload_stored: list[BlockStored] = []  # the last step's, now complete

    def stored(self, request: SimRequest, first: int, fresh: Sequence[bool]) -> None:
        """Blocks ``first ..`` of ``request`` were just cached; ``fresh[i]`` says whether
        block ``first + i`` was cached by this request (not already held)."""
        upto = first + len(fresh)
        names = self._engine_hashes(request, upto)
        for start, end in fresh_runs(first, fresh):
            self._store_run(request, names, start, end)

    def removed(self, pool_hash: int) -> None:
        name = self._names.pop(pool_hash, None)
        self._stored.pop(pool_hash, None)
        if name is not None:
            self._pending.append(
                BlockRemoved(
                    block_hashes=[self._external(name)], medium=MEDIUM, group_idx=self.group
                )
            )

    def offload_stored(self, request: SimRequest, first: int, fresh: Sequence[bool]) -> None:
        """Blocks ``first ..`` of ``request``, cached on the GPU (``stored`` named them),
        were written to the offload tier; ``fresh[i]``: block ``first + i`` was not there."""
        names = request.engine_hashes
        for i, is_fresh in enumerate(fresh, start=first):
            if not is_fresh:
                continue
            self._offload_names[request.hashes[i]] = names[i]
            if self.self_describing:
                self._offload_storing.append(self._offloaded_block(request, names, i))
            else:
                self._offload_storing.append(self._placeholder(names[i]))

    def window_stored(
        self, request: SimRequest, first: int, kept: Sequence[int], group: int
    ) -> None:
        """Window group ``group`` keeps blocks ``kept`` of ``request`` (named as the
        full-attention group names them); its event's tokens span from block ``first``."""
        assert self.windows is not None
        end = max(kept) + 1
        names = self._engine_hashes(request, end)
        for i in kept:
            self._window_names[(group, request.hashes[i])] = names[i]
        self._windowed.append(
            BlockStored(
                block_hashes=[self._external(names[i]) for i in kept],
                parent_block_hash=self._external(names[first - 1]) if first else None,
                token_ids=self._token_ids(request, first, end),
                block_size=self.block_tokens,
                lora_id=None,
                medium=MEDIUM,
                lora_name=None,
                extra_keys=[None] * len(kept),
                group_idx=group,
                kv_cache_spec_kind=WINDOW_KIND,
                kv_cache_spec_sliding_window=self.windows[0],
            )
        )

    def window_removed(self, group: int, pool_hash: int) -> None:
        name = self._window_names.pop((group, pool_hash), None)
        if name is not None:
            self._pending.append(
                BlockRemoved(block_hashes=[self._external(name)], medium=MEDIUM, group_idx=group)
            )

    def offload_removed(self, pool_hash: int) -> None:
        name = self._offload_names.pop(pool_hash, None)
        if name is not None:
            self._offload_evicted.append(self._external(name))

    def _offloaded_block(self, request: SimRequest, names: list[bytes], i: int) -> BlockStored:
        """As the connector's ``OffloadingEventsTracker`` describes a stored chunk of one
        block."""
        return BlockStored(
            block_hashes=[self._external(names[i])],
            parent_block_hash=self._external(names[i - 1]) if i else None,
            token_ids=self._token_ids(request, i, i + 1),
            block_size=self.block_tokens,
            lora_id=None,
            medium=OFFLOAD_MEDIUM,
            lora_name=None,
            extra_keys=None,
            group_idx=self.group,
            kv_cache_spec_kind=SPEC_KIND,
        )

    def _placeholder(self, name: bytes) -> BlockStored:
        return BlockStored(
            block_hashes=[self._external(name)],
            parent_block_hash=None,
            token_ids=[],
            block_size=0,
            lora_id=None,
            medium=OFFLOAD_MEDIUM,
            lora_name=None,
            group_idx=self.group,
        )

    def cleared(self) -> None:
        self._window_names.clear()
        self._names.clear()
        self._stored.clear()
        self._pending.append(AllBlocksCleared())

    def described(self, pool_hash: int) -> StoredBlock | None:
        """What the cached block ``pool_hash`` was announced as (None: never announced)."""
        return self._stored.get(pool_hash)

    def restored(self, blocks: Sequence[tuple[int, StoredBlock | None]]) -> None:
        """The pool was loaded from a checkpoint: ``AllBlocksCleared``, then a
        ``BlockStored`` for each (pool hash, block) described, in the order given
        (parents first), published at once. Blocks not described stay unannounced."""
        self.cleared()
        for pool_hash, block in blocks:
            if block is None:
                continue
            self._names[pool_hash] = block.name
            self._stored[pool_hash] = block
            self._pending.append(
                BlockStored(
                    block_hashes=[self._external(block.name)],
                    parent_block_hash=(
                        self._external(block.parent) if block.parent is not None else None
                    ),
                    token_ids=token_ids(block.tokens),
                    block_size=self.block_tokens,
                    lora_id=None,
                    medium=MEDIUM,
                    lora_name=None,
                    extra_keys=[event_extra_keys(block_extra_keys(0, block.cache_salt))],
                    group_idx=self.group,
                    kv_cache_spec_kind=SPEC_KIND,
                )
            )
        self.flush()

    def flush(self) -> None:
        """Publish what the step produced (vLLM: ``Scheduler.update_from_output``): the
        pool's events, then the connector's."""
        if self._offload_evicted:
            self._pending.append(
                BlockRemoved(
                    block_hashes=self._offload_evicted, medium=OFFLOAD_MEDIUM, group_idx=self.group
                )
            )
            self._offload_evicted = []
        self._pending += self._offload_stored
        self._offload_stored, self._offload_storing = self._offload_storing, []
        if self._windowed:
            self._pending[:0] = self._windowed
            self._windowed = []
        if self._pending:
            self.sink.publish(KVEventBatch(ts=time.time(), events=self._pending))
            self._pending = []

    def idle(self) -> None:
        """Nothing left to run: the stores in flight complete and go out."""
        if self._offload_stored:
            self.flush()

    def _store_run(self, request: SimRequest, names: list[bytes], start: int, end: int) -> None:
        step = self.block_tokens * TOKEN_BYTES
        for i in range(start, end):
            pool_hash = request.hashes[i]
            self._names[pool_hash] = names[i]
            self._stored[pool_hash] = StoredBlock(
                names[i],
                names[i - 1] if i else None,
                self._block_bytes(request, i * step, (i + 1) * step),
                request.cache_salt if i == 0 else None,
            )
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
                group_idx=self.group,
                kv_cache_spec_kind=SPEC_KIND,
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
        return token_ids(self._block_bytes(request, start * step, end * step))

    @staticmethod
    def _block_bytes(request: SimRequest, lo: int, hi: int) -> bytes:
        prompt = request.prompt
        return prompt[lo:hi] if hi <= len(prompt) else request.tokens[lo:hi]

    def _external(self, name: bytes) -> bytes | int:
        return external_hash(name, self.int_hashes)
