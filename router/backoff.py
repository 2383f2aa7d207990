"""How long to wait before trying again: a delay that doubles on each failure."""

from __future__ import annotations


class Backoff:
    """``first_s``, then twice the last delay, never above ``max_s``; ``reset`` after a
    success starts over from ``first_s``."""

    __slots__ = ("_first_s", "_max_s", "_next_s")

    def __init__(self, first_s: float, max_s: float) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError("backoff: needs 0 < first_s <= max_s")
        self._first_s = first_s
        self._max_s = max_s
        self._next_s = first_s

    def next(self) -> float:
        """The delay before this attempt; the next one will be twice as long."""
        delay = self._next_s
        self._next_s = min(self._max_s, delay * 2)
        return delay

    def reset(self) -> None:
        self._next_s = self._first_s
