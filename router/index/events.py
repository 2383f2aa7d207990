"""KV events as engines publish them over ZMQ, decoded into plain values.

A message is three frames, ``(topic, seq, payload)``: ``seq`` is 8 bytes big-endian
(``-1`` ends a replay), ``payload`` a msgpack batch ``[ts, events, rank]`` (vLLM's
``KVEventBatch``, SGLang's with ``attn_dp_rank``). Each event is either a tagged map,
``{"type": "BlockStored", field: value, ...}`` (vLLM >= 0.24, SGLang), or, from older
vLLM, a positional array ``["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium]``. Block hashes are opaque: bytes (vLLM's sha256 default)
or integers (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, SGLang).

Whatever a worker sends, ``decode_batch`` returns events or raises ``MalformedEvents``;
nothing else escapes it, and no event can claim more tokens than its blocks hold.

An engine that offloads blocks (vLLM's offloading connector, LMCache) also announces
blocks stored to and removed from its CPU memory or storage (``medium`` ``"CPU"``,
``"STORAGE"``; some connectors lowercase). The CPU tier's events are kept, their medium
spelled ``"CPU"``, and told apart by ``offloaded``: a block there is not cached on the
GPU, and its removal from CPU does not drop a copy still on the GPU. Without the
connector's ``self_describing_kv_events`` a CPU store is a *placeholder*: the block's
hash alone, no tokens, ``block_size`` 0 (allowed on the CPU tier only). Other tiers'
events (storage) are left out of the batch.

A hybrid model's engine keeps several KV cache groups and announces each
(``group_idx``, ``kv_cache_spec_kind``; vLLM 0.32): full attention (and MLA) keeps every
block of a prefix; a sliding-window group keeps only the blocks of the last window
before the points a later request can hit (a prompt's end, a shared-prefix junction),
and its ``BlockStored`` names those blocks alone while its ``token_ids`` still span every
block from its parent on (``windowed``: the token count is not checked). Groups of
other kinds (Mamba state, encoder or cross attention) hold no reusable prefix and are
left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeAlias, TypeGuard

import msgspec

BlockHash: TypeAlias = bytes | int

END_OF_REPLAY = -1
SEQ_BYTES = 8
# Beyond any real block size (vLLM allows up to 256 tokens a block).
MAX_BLOCK_SIZE = 4096
# Beyond any real sliding window (tokens).
MAX_WINDOW = 1 << 24
# vLLM's medium for blocks in the engine's own KV cache (SGLang and older vLLM send none).
DEVICE_MEDIUM = "GPU"
# vLLM's medium for the offloading connector's tier in host memory.
OFFLOAD_MEDIUM = "CPU"


# vLLM's KVCacheSpecKind values (v1/kv_cache_interface.py): groups whose blocks a prefix
# hit needs, every one of them, or the last window's.
FULL_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
WINDOWED_KINDS = frozenset({"sliding_window", "sliding_window_mla", "chunked_local_attention"})


def kind_kept(kind: str | None) -> bool:
    """A group of this kind holds prefix blocks (None: a single-group engine's)."""
    return kind is None or kind in FULL_KINDS or kind in WINDOWED_KINDS


def kept(medium: str | None) -> bool:
    """An event on this medium is read: the GPU's (or none named) and the CPU tier's."""
    return medium is None or medium.upper() in (DEVICE_MEDIUM, OFFLOAD_MEDIUM)


def _spelled(medium: str | None) -> str | None:
    return None if medium is None else medium.upper()


class MalformedEvents(ValueError):
    """A message that is not a KV event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    # The request's cache_salt, from SGLang's field or vLLM's first block's extra keys.
    cache_salt: str | None = None
    group_idx: int | None = None
    # A sliding-window group's (hybrid models): its window in tokens; None: a group
    # that keeps every block (full attention, MLA, a single-group engine).
    sliding_window: int | None = None

    @property
    def offloaded(self) -> bool:
        """Stored to the CPU tier, not the GPU's cache."""
        return self.medium == OFFLOAD_MEDIUM

    @property
    def windowed(self) -> bool:
        return self.sliding_window is not None

    @property
    def placeholder(self) -> bool:
        """A CPU store naming its block by hash alone (no tokens to chain)."""
        return self.offloaded and not self.token_ids


# Removals and clears are decoded straight into these (msgspec, in C): vLLM sends one
# BlockRemoved per evicted block, thousands a second from a busy engine.
class BlockRemoved(msgspec.Struct, frozen=True, tag="BlockRemoved", tag_field="type"):
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None

    @property
    def offloaded(self) -> bool:
        """Removed from the CPU tier (any copy on the GPU stays)."""
        return self.medium == OFFLOAD_MEDIUM


class AllBlocksCleared(msgspec.Struct, frozen=True, tag="AllBlocksCleared", tag_field="type"):
    pass


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    rank: int | None


@dataclass(frozen=True, slots=True)
class Message:
    topic: bytes
    seq: int
    payload: bytes

    @property
    def ends_replay(self) -> bool:
        return self.seq == END_OF_REPLAY


def read_message(frames: Sequence[bytes]) -> Message:
    """A published or replayed message from its frames (the replay's leading empty
    delimiter already taken off)."""
    if len(frames) != 3:
        raise MalformedEvents(f"a KV event message has 3 frames, not {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != SEQ_BYTES:
        raise MalformedEvents(f"a sequence number has {SEQ_BYTES} bytes, not {len(seq)}")
    return Message(bytes(topic), int.from_bytes(seq, "big", signed=True), bytes(payload))


TokenId = Annotated[int, msgspec.Meta(ge=0)]


class _Stored(msgspec.Struct, frozen=True, tag="BlockStored", tag_field="type"):
    """A tagged BlockStored as vLLM >= 0.24 and SGLang send it (unknown fields ignored)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[TokenId, ...]
    block_size: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_SIZE)]
    lora_name: str | None = None
    medium: str | None = None
    cache_salt: str | None = None
    extra_keys: Any = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _TaggedBatch(msgspec.Struct, frozen=True, array_like=True):
    ts: float
    events: tuple[_Stored | BlockRemoved | AllBlocksCleared, ...]
    rank: int | None = None


_TAGGED = msgspec.msgpack.Decoder(_TaggedBatch)


def decode_batch(payload: bytes) -> EventBatch:
    """Tagged maps are typed in C; what does not fit them (older vLLM's arrays, or
    anything malformed) is read field by field, which names what is wrong."""
    try:
        tagged = _TAGGED.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
        return _decode_generic(payload)
    decoded = (_from_tagged(e) for e in tagged.events)
    return EventBatch(tagged.ts, tuple(e for e in decoded if e is not None), tagged.rank)


def _from_tagged(event: _Stored | BlockRemoved | AllBlocksCleared) -> Event | None:
    """The event; None for a tier left out (checked first: its fields may be anything)."""
    if isinstance(event, AllBlocksCleared):
        return event
    if not kept(event.medium):
        return None
    medium = _spelled(event.medium)
    if isinstance(event, BlockRemoved):
        return event if medium == event.medium else msgspec.structs.replace(event, medium=medium)
    if not kind_kept(event.kv_cache_spec_kind):
        return None
    window = _window(event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window)
    _check_size(event.block_size, len(event.token_ids), len(event.block_hashes), medium, window)
    salt = event.cache_salt
    if salt is None:
        salt = _salt_of_first_block(event.extra_keys, event.lora_name)
    return BlockStored(
        event.block_hashes,
        event.parent_block_hash,
        event.token_ids,
        event.block_size,
        event.lora_name,
        medium,
        salt,
        event.group_idx,
        window,
    )


def _window(kind: str | None, window: int | None) -> int | None:
    """A windowed group's window in tokens (None: it keeps every block)."""
    if kind not in WINDOWED_KINDS:
        return None
    if window is None or not 0 < window <= MAX_WINDOW:
        raise MalformedEvents(f"a {kind} group's window {window!r} is not a window")
    return window


def _check_size(
    block_size: int, tokens: int, blocks: int, medium: str | None, window: int | None
) -> None:
    """A sliding-window group's tokens span more blocks than it names (not checked)."""
    placeholder = medium == OFFLOAD_MEDIUM and tokens == 0
    if block_size == 0 and not placeholder:
        raise MalformedEvents("block_size 0 is a CPU-tier placeholder's alone")
    if window is None and not placeholder and tokens != block_size * blocks:
        raise MalformedEvents("token_ids are block_size tokens for each block hash")


def _decode_generic(payload: bytes) -> EventBatch:
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:
        raise MalformedEvents(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or not 2 <= len(raw) <= 3:
        raise MalformedEvents("a batch is [ts, events, rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if not _is_number(ts) or not isinstance(events, list):
        raise MalformedEvents("a batch is [ts, events, rank]")
    if rank is not None and not _is_int(rank):
        raise MalformedEvents("a batch's rank is an integer")
    decoded = (_event(e) for e in events)
    return EventBatch(float(ts), tuple(e for e in decoded if e is not None), rank)


_STORED_POSITIONS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
)
_REMOVED_POSITIONS = ("block_hashes", "medium")


def _event(raw: Any) -> Event | None:
    """The event; None for a tier left out (checked before the rest: its fields may be
    anything)."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        names = {"BlockStored": _STORED_POSITIONS, "BlockRemoved": _REMOVED_POSITIONS}.get(
            kind if isinstance(kind, str) else "", ()
        )
        if len(raw) - 1 > len(names):
            raise MalformedEvents(f"too many fields for {kind!r}")
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise MalformedEvents("an event is a tagged map or array")
    medium = _optional_str(fields.get("medium"), "medium")
    if kind in ("BlockStored", "BlockRemoved") and not kept(medium):
        return None
    medium = _spelled(medium)
    spec_kind = _optional_str(fields.get("kv_cache_spec_kind"), "kv_cache_spec_kind")
    if kind == "BlockStored" and not kind_kept(spec_kind):
        return None
    if kind == "BlockStored":
        window = _optional_int(
            fields.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window"
        )
        return _stored(fields, medium, _window(spec_kind, window))
    if kind == "BlockRemoved":
        return BlockRemoved(
            _hashes(fields.get("block_hashes")),
            medium,
            _optional_int(fields.get("group_idx"), "group_idx"),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise MalformedEvents(f"unknown event type {kind!r}")


def _stored(fields: dict[str, Any], medium: str | None, window: int | None) -> BlockStored:
    hashes = _hashes(fields.get("block_hashes"))
    parent = fields.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise MalformedEvents("parent_block_hash is bytes, an integer or nil")
    size = fields.get("block_size")
    if not _is_int(size) or not 0 <= size <= MAX_BLOCK_SIZE:
        raise MalformedEvents(f"block_size {size!r} is not a block size")
    tokens = fields.get("token_ids")
    if not isinstance(tokens, list):
        raise MalformedEvents("token_ids are block_size tokens for each block hash")
    _check_size(size, len(tokens), len(hashes), medium, window)
    # At C speed: one prefill's event carries tens of thousands of ids. ``type`` (not
    # isinstance) keeps booleans out, as _is_int does.
    if tokens and (set(map(type, tokens)) != {int} or min(tokens) < 0):
        raise MalformedEvents("token ids are non-negative integers")
    lora_name = _optional_str(fields.get("lora_name"), "lora_name")
    salt = _optional_str(fields.get("cache_salt"), "cache_salt")
    if salt is None:
        salt = _salt_of_first_block(fields.get("extra_keys"), lora_name)
    return BlockStored(
        hashes,
        parent,
        tuple(tokens),
        size,
        lora_name,
        medium,
        salt,
        _optional_int(fields.get("group_idx"), "group_idx"),
        window,
    )


def _salt_of_first_block(extra_keys: Any, lora_name: str | None) -> str | None:
    """vLLM publishes, per block, the LoRA name (when set), ``[mm_identifier, offset]``
    pairs, then the cache_salt string (first block only), untagged: the salt is the
    first string after the LoRA name."""
    if not isinstance(extra_keys, list) or not extra_keys:
        return None
    first = extra_keys[0]
    if not isinstance(first, list):
        return None
    keys = first[1:] if lora_name is not None and first[:1] == [lora_name] else first
    return next((k for k in keys if isinstance(k, str)), None)


def _hashes(raw: Any) -> tuple[BlockHash, ...]:
    if not isinstance(raw, list) or not set(map(type, raw)) <= _HASH_TYPES:
        raise MalformedEvents("block_hashes is a list of bytes or integers")
    return tuple(raw)


_HASH_TYPES = frozenset({bytes, int})


def _is_hash(value: Any) -> TypeGuard[BlockHash]:
    return isinstance(value, bytes) or _is_int(value)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or isinstance(value, float)


def _optional_str(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise MalformedEvents(f"{name} is a string or nil")
    return str(value) if value is not None else None


def _optional_int(value: Any, name: str) -> int | None:
    if value is not None and not _is_int(value):
        raise MalformedEvents(f"{name} is an integer or nil")
    return int(value) if value is not None else None
