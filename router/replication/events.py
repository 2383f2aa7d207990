"""Index changes as they travel between replicas on the Redis stream."""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from router.replication.keys import MEMBER_BYTES

Op = Literal["touch", "forget", "purge"]
# Hashes one change may carry: a prompt's blocks (a 1M-token prompt at 16 tokens a block
# is 65,536). A larger one is no replica's, and unpacking it would cost the loop.
MAX_EVENT_HASHES = 1 << 17
_OPS: dict[bytes, Op] = {b"t": "touch", b"f": "forget", b"p": "purge"}
_CODES: dict[Op, bytes] = {v: k for k, v in _OPS.items()}


@dataclass(frozen=True, slots=True)
class IndexEvent:
    op: Op
    worker: str
    hashes: tuple[int, ...]  # head first, as the prefix runs
    # A purge for an engine restart: the engine's process start time, so that every
    # replica applies the purge once per restart, whichever replica saw it first.
    started: float | None = None


def pack_hashes(hashes: tuple[int, ...] | list[int]) -> bytes:
    return array("Q", hashes).tobytes()


def unpack_hashes(data: bytes) -> tuple[int, ...]:
    values = array("Q")
    values.frombytes(data)
    return tuple(values)


def encode(event: IndexEvent, replica: str) -> dict[bytes, bytes]:
    fields = {
        b"r": replica.encode(),
        b"o": _CODES[event.op],
        b"w": event.worker.encode(),
        b"h": pack_hashes(event.hashes),
    }
    if event.started is not None:
        fields[b"s"] = repr(event.started).encode()
    return fields


def decode(fields: Mapping[bytes, bytes]) -> tuple[str, IndexEvent] | None:
    """The sending replica and the event; None for a malformed entry."""
    try:
        op = _OPS[fields[b"o"]]
        if len(fields[b"h"]) > MAX_EVENT_HASHES * MEMBER_BYTES:
            return None
        started = fields.get(b"s")
        if started is not None and not math.isfinite(float(started)):
            return None
        return fields[b"r"].decode(), IndexEvent(
            op,
            fields[b"w"].decode(),
            unpack_hashes(fields[b"h"]),
            float(started) if started is not None else None,
        )
    except (KeyError, ValueError, UnicodeDecodeError):
        return None
