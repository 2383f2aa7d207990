"""The index changes this replica made and Redis does not have yet.

A change stays here until the pipeline that carries it has succeeded: a batch is read
with ``peek`` and removed with ``sent`` only after Redis answered, so a failed send loses
nothing. The outbox is bounded by the hashes it holds, not by its number of changes,
because one change carries a whole prompt's hashes (about 6,000 for a 100K-token prompt).
Past the bound (Redis away for long) it drops the touches (and the forgets too if even
they do not fit) and counts what it dropped: the publisher then resyncs, which pushes
this replica's whole index back, so only the dropped touches' order is lost. Purges and
forgets are kept because a resync merges Redis's copy back in, and a removal not yet
sent would come back from it.
"""

from __future__ import annotations

from collections import deque

from router.replication.events import IndexEvent

# About 50 MB of Python ints at most; a minute of heavy traffic with Redis away.
MAX_HASHES = 1_000_000


class Outbox:
    def __init__(self, max_hashes: int = MAX_HASHES) -> None:
        self.max_hashes = max_hashes
        self._events: deque[IndexEvent] = deque()
        self.hashes = 0  # hashes held over all queued changes
        # Bumped whenever the queue is cut short, so a batch peeked before it is not
        # taken off the new queue when its send completes.
        self._generation = 0
        self._dropped = 0  # changes dropped since ``take_dropped``

    def __len__(self) -> int:
        return len(self._events)

    def __bool__(self) -> bool:
        return bool(self._events)

    def append(self, event: IndexEvent) -> None:
        self._events.append(event)
        self.hashes += len(event.hashes)
        if self.hashes > self.max_hashes:
            self._overflow()

    def peek(self, limit: int) -> tuple[int, list[IndexEvent]]:
        """Up to ``limit`` of the oldest changes, and the generation to hand ``sent``."""
        events = self._events
        return self._generation, [events[i] for i in range(min(limit, len(events)))]

    def sent(self, generation: int, count: int) -> None:
        """The oldest ``count`` changes, peeked in ``generation``, reached Redis."""
        if generation != self._generation:
            return  # the queue was cut short meanwhile: those changes left with it
        for _ in range(min(count, len(self._events))):
            self.hashes -= len(self._events.popleft().hashes)

    def take_dropped(self) -> int:
        """Changes dropped by overflows since the last call."""
        dropped, self._dropped = self._dropped, 0
        return dropped

    def clear(self) -> None:
        self._generation += 1
        self._events.clear()
        self.hashes = 0

    def _overflow(self) -> None:
        # A resync merges Redis's copy back in, so what was taken away must not be
        # dropped: purges always stay, forgets while they fit.
        kept = [e for e in self._events if e.op != "touch"]
        if sum(len(e.hashes) for e in kept) > self.max_hashes:
            kept = [e for e in kept if e.op == "purge"]
        self._dropped += len(self._events) - len(kept)
        self.clear()
        self._events.extend(kept)
        self.hashes = sum(len(e.hashes) for e in kept)
