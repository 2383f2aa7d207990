"""Index changes as they travel between replicas on the Redis stream."""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Op = Literal["touch", "forget", "purge"]
_OPS: dict[bytes, Op] = {b"t": "touch", b"f": "forget", b"p": "purge"}
_CODES: dict[Op, bytes] = {v: k for k, v in _OPS.items()}


@dataclass(frozen=True, slots=True)
class IndexEvent:
    op: Op
    worker: str
    hashes: tuple[int, ...]  # head first, as the prefix runs


def pack_hashes(hashes: tuple[int, ...] | list[int]) -> bytes:
    return array("Q", hashes).tobytes()


def unpack_hashes(data: bytes) -> tuple[int, ...]:
    values = array("Q")
    values.frombytes(data)
    return tuple(values)


def encode(event: IndexEvent, replica: str) -> dict[bytes, bytes]:
    return {
        b"r": replica.encode(),
        b"o": _CODES[event.op],
        b"w": event.worker.encode(),
        b"h": pack_hashes(event.hashes),
    }


def decode(fields: Mapping[bytes, bytes]) -> tuple[str, IndexEvent] | None:
    """The sending replica and the event; None for a malformed entry."""
    try:
        op = _OPS[fields[b"o"]]
        return fields[b"r"].decode(), IndexEvent(
            op, fields[b"w"].decode(), unpack_hashes(fields[b"h"])
        )
    except (KeyError, ValueError, UnicodeDecodeError):
        return None
