"""Checkpoint and restore of a simulated engine's KV cache (``POST /sim/checkpoint``,
``POST /sim/restore``, ``kvrouter sim engine --restore FILE``).

What a GPU checkpoint of a vLLM process (CRIU with cuda-checkpoint) keeps of the
engine, and what a restore shows the outside world:

* **The cache**: every block's hash in eviction order (``BlockPool.eviction_order``),
  so the restored engine hits, misses and evicts exactly as the original would have.
  Requests in flight are not kept (they fail with the worker): their blocks are taken
  as if they were aborted at that instant, so a running request's full blocks stay
  cached, at the most recently used end, and its unfilled blocks are empty.
* **The KV events' names** (vLLM flavour, with KV events published): each block's vLLM
  hash, parent and tokens (``kv_event_log.StoredBlock``), so the restored engine names
  the blocks as the original did and can announce them.
* **Counters that describe the cache**: the prefix-cache queries and hits
  (``vllm:prefix_cache_queries``/``_hits``, SGLang's cached tokens) continue from the
  checkpoint's totals, as does the request counter and the random state that draws
  reply lengths (a restored engine answers the next request as the original would).
* **Not kept**: requests, the request log, stored ``/v1/responses`` answers.

A restore is a new process: ``process_start_time_seconds`` is the time of the restore
and every other series starts from zero (as a restarted process's would), and KV
events come from a new publisher (sequence 0): ``AllBlocksCleared``, then one
``BlockStored`` per restored block, most recently used first so that a parent is
announced before its children (a subscriber chains a block to its parent). The
SGLang flavour keeps no tokens per page and announces ``AllBlocksCleared`` only, as
does a checkpoint taken with KV events off. The router purges a worker's index when
its start time changes unless it is told of a migration (``POST
/admin/workers/{name}/migrate``).

A checkpoint holds only for the engine it was taken against (:class:`Identity`: the
flavour, the model, the block size, the number of blocks and what names blocks — the
hash algorithm and ``PYTHONHASHSEED``): restoring it elsewhere is refused
(:class:`CheckpointMismatch`), as a real one taken on other hardware or versions is
invalid and the workload starts cold.

The file is msgpack (``msgspec``): a map with ``format`` (``FORMAT``) and ``version``
(``VERSION``) beside the state, written to a temporary file and renamed into place.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from bench.sim.kv_cache import NO_HASH
from bench.sim.kv_event_log import StoredBlock

if TYPE_CHECKING:
    from bench.sim.engine import Engine

FORMAT = "kvrouter-sim-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """The file is not a checkpoint this engine can read, or cannot be read or written.

    ``CheckpointMismatch``: a checkpoint of another engine (model, size, hashing).
    ``EngineBusy`` (not a ``CheckpointError``): the engine has requests running."""


class CheckpointMismatch(CheckpointError):
    pass


class EngineBusy(Exception):
    """A restore asked of an engine with requests running."""


class Identity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a checkpoint is valid for."""

    flavor: str
    model: str  # the served model name
    architecture: str  # the model config's name
    block_tokens: int
    num_blocks: int
    hash_algo: str | None  # vLLM's --prefix-caching-hash-algo; None for SGLang
    hash_seed: str | None  # PYTHONHASHSEED (vLLM's NONE_HASH seed); None for SGLang

    def differences(self, other: Identity) -> list[str]:
        """``field: mine != other's`` for each field that differs."""
        return [
            f"{name} {getattr(self, name)!r} != {getattr(other, name)!r}"
            for name in self.__struct_fields__
            if getattr(self, name) != getattr(other, name)
        ]


class _Header(msgspec.Struct):
    format: str
    version: int


class Checkpoint(msgspec.Struct, frozen=True, kw_only=True):
    format: str = FORMAT
    version: int = VERSION
    identity: Identity
    taken_at: float  # unix seconds
    # Every block's pool hash in eviction order, NO_HASH for an empty block.
    blocks: list[int]
    # Parallel to ``blocks``: what each was announced as (vLLM KV events); None: not kept.
    events: list[StoredBlock | None] | None = None
    prefix_queries: int = 0
    prefix_hits: int = 0
    requests_submitted: int = 0
    rng_state: tuple[int, list[int], float | None] | None = None

    @property
    def cached_blocks(self) -> int:
        return sum(1 for h in self.blocks if h != NO_HASH)


def identity(engine: Engine) -> Identity:
    config = engine.config
    vllm = config.flavor == "vllm"
    return Identity(
        flavor=config.flavor,
        model=config.served_model_name,
        architecture=config.model.name,
        block_tokens=engine.block_tokens,
        num_blocks=engine.num_blocks,
        hash_algo=config.prefix_caching_hash_algo if vllm else None,
        hash_seed=os.environ.get("PYTHONHASHSEED") if vllm else None,
    )


def take(engine: Engine) -> Checkpoint:
    """The engine's cache as a checkpoint, its running requests taken as aborted."""
    held = [request.blocks for request in engine.scheduler.running]
    blocks = engine.pool.eviction_order(held)
    events = engine.scheduler.events
    described: list[StoredBlock | None] | None = None
    if events is not None:
        described = [events.described(h) if h != NO_HASH else None for h in blocks]
        if not any(described):
            described = None
    version, state, gauss = engine.rng_state()
    return Checkpoint(
        identity=identity(engine),
        taken_at=time.time(),
        blocks=blocks,
        events=described,
        prefix_queries=engine.prefix_queries,
        prefix_hits=engine.prefix_hits,
        requests_submitted=engine.requests_submitted,
        rng_state=(version, list(state), gauss),
    )


def write(path: str, checkpoint: Checkpoint) -> int:
    """Write ``checkpoint`` to ``path`` atomically; returns the bytes written."""
    data = msgspec.msgpack.encode(checkpoint)
    target = Path(path)
    try:
        fd, temp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as exc:
        raise CheckpointError(f"cannot write a checkpoint to {path}: {exc}") from exc
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        Path(temp).replace(target)
    except OSError as exc:
        Path(temp).unlink(missing_ok=True)
        raise CheckpointError(f"cannot write a checkpoint to {path}: {exc}") from exc
    return len(data)


def read(path: str) -> Checkpoint:
    """The checkpoint in ``path``; ``CheckpointError`` names what is wrong with it."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    try:
        header = msgspec.msgpack.decode(data, type=_Header)
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"{path} is not a simulated engine checkpoint ({exc})") from exc
    if header.format != FORMAT:
        raise CheckpointError(f"{path} is not a simulated engine checkpoint: {header.format!r}")
    if header.version != VERSION:
        raise CheckpointError(
            f"{path} is a version {header.version} checkpoint; this engine reads version {VERSION}"
        )
    try:
        checkpoint = msgspec.msgpack.decode(data, type=Checkpoint)
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"{path} is a damaged checkpoint ({exc})") from exc
    if checkpoint.events is not None and len(checkpoint.events) != len(checkpoint.blocks):
        raise CheckpointError(f"{path} is a damaged checkpoint (events do not match blocks)")
    return checkpoint


def check(engine: Engine, checkpoint: Checkpoint) -> None:
    """Refuse a checkpoint taken against another engine."""
    differences = identity(engine).differences(checkpoint.identity)
    if differences:
        raise CheckpointMismatch(
            "the checkpoint was taken against another engine (this engine's != the "
            f"checkpoint's): {'; '.join(differences)}"
        )


def apply(engine: Engine, checkpoint: Checkpoint) -> None:
    """Load ``checkpoint`` into a new, idle engine (one that has just started or
    restarted) and announce its blocks on the KV events."""
    check(engine, checkpoint)
    if engine.pool.num_free < engine.pool.num_blocks:
        # Only if a request was scheduled while a restart swapped the KV publisher.
        raise EngineBusy("requests hold blocks: a checkpoint is restored only when idle")
    try:
        engine.pool.load(checkpoint.blocks)
    except ValueError as exc:
        raise CheckpointError(f"a damaged checkpoint: {exc}") from exc
    engine.restore_counters(
        checkpoint.prefix_queries,
        checkpoint.prefix_hits,
        checkpoint.requests_submitted,
        _rng_state(checkpoint.rng_state),
    )
    events = engine.scheduler.events
    if events is not None:
        described = checkpoint.events or [None] * len(checkpoint.blocks)
        # Most recently used first: a block is released with or after its children.
        events.restored(
            [
                (h, block)
                for h, block in zip(reversed(checkpoint.blocks), reversed(described), strict=True)
            ]
        )


async def restore(engine: Engine, checkpoint: Checkpoint) -> None:
    """Replace a running engine's cache with ``checkpoint``'s, as a new process restored
    from it would hold it: refused (``CheckpointMismatch``) for another engine's
    checkpoint and (``EngineBusy``) while requests run, the cache then untouched."""
    check(engine, checkpoint)
    if engine.scheduler.has_work:
        raise EngineBusy("requests are running: a checkpoint is restored only when idle")
    await engine.restart()
    apply(engine, checkpoint)


def _rng_state(state: tuple[int, list[int], float | None] | None) -> Any:
    return None if state is None else (state[0], tuple(state[1]), state[2])


def summary(path: str, checkpoint: Checkpoint, size: int) -> dict[str, Any]:
    """What an endpoint answers about a checkpoint written or restored."""
    return {
        "path": path,
        "bytes": size,
        "version": checkpoint.version,
        "blocks": len(checkpoint.blocks),
        "cached_blocks": checkpoint.cached_blocks,
        "taken_at": checkpoint.taken_at,
    }
