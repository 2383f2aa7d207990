"""A batch of KV events cut into slices of bounded work, so that applying one never
holds the event loop for long: an engine may announce hundreds of thousands of blocks
in one batch (a cleared cache refilled, a replay), and one ``BlockStored`` may carry
them all. A long ``BlockStored`` is cut into runs of blocks, each run's parent the last
block of the run before it, which is how the engine would have announced them one run
at a time; a long ``BlockRemoved`` is cut likewise."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

from router.index.events import AllBlocksCleared, BlockRemoved, Event

# Blocks applied between two yields to the loop: a few milliseconds of work.
SLICE_BLOCKS = 2048


def event_slices(events: Iterable[Event], limit: int = SLICE_BLOCKS) -> Iterator[list[Event]]:
    """``events`` in order, in lists of about ``limit`` blocks each."""
    piece: list[Event] = []
    size = 0
    for event in events:
        for part in _parts(event, limit):
            blocks = 1 if isinstance(part, AllBlocksCleared) else len(part.block_hashes)
            if piece and size + blocks > limit:
                yield piece
                piece, size = [], 0
            piece.append(part)
            size += blocks
    if piece:
        yield piece


def _parts(event: Event, limit: int) -> Iterator[Event]:
    if isinstance(event, AllBlocksCleared) or len(event.block_hashes) <= limit:
        yield event
        return
    hashes = event.block_hashes
    if isinstance(event, BlockRemoved):
        for start in range(0, len(hashes), limit):
            yield BlockRemoved(hashes[start : start + limit], event.medium, event.group_idx)
        return
    size = event.block_size
    for start in range(0, len(hashes), limit):
        yield dataclasses.replace(
            event,
            block_hashes=hashes[start : start + limit],
            parent_block_hash=event.parent_block_hash if start == 0 else hashes[start - 1],
            token_ids=event.token_ids[start * size : (start + limit) * size],
        )
