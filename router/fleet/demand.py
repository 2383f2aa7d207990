"""Recent demand on a worker: the prompt tokens sent to it, fading with a half-life.

A worker's resident tokens say what its cache holds, including sessions that ended long
ago; after warm-up every cache is full and resident tokens no longer tell workers apart.
What was sent recently does: a live coding-agent session re-sends its whole context
every turn (every 10-20 s), a finished one sends nothing. A half-life of a few turns
keeps the sum about the sessions still running, so a new session can be placed beside
the least live context rather than beside the least garbage.
"""

from __future__ import annotations

import math

DEFAULT_HALF_LIFE_S = 30.0


class RecentDemand:
    """An exponentially fading sum, updated lazily (O(1) per add or read)."""

    __slots__ = ("_at", "_decay_per_s", "_value")

    def __init__(self, half_life_s: float = DEFAULT_HALF_LIFE_S) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self._decay_per_s = math.log(2) / half_life_s
        self._value = 0.0
        self._at = 0.0

    def value(self, now: float) -> float:
        if now <= self._at:
            return self._value
        return self._value * math.exp(-self._decay_per_s * (now - self._at))

    def add(self, amount: float, now: float) -> None:
        self._value = self.value(now) + amount
        self._at = max(self._at, now)

    def reset(self, value: float, now: float) -> None:
        """The sum is ``value`` as of ``now`` (another replica's, as it last said)."""
        self._value = value
        self._at = now
