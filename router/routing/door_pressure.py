"""``RecentWaits``: of the turns of sessions under way lately, the share that had to wait.

The queue's door (``router.routing.queue``, ``door_pressure``) stays shut while that
share is high: a turn held now and then says little, most of them held says the fleet is
full for the sessions it has.
"""

from __future__ import annotations

from collections import deque

# Turns the share is judged on: at least, and at most remembered.
MIN_PRESSURE_TURNS = 10
MAX_TURNS_REMEMBERED = 4096


class RecentWaits:
    __slots__ = ("_held", "_turns")

    def __init__(self) -> None:
        self._turns: deque[tuple[float, bool]] = deque()  # (when, held), oldest first
        self._held = 0

    def add(self, now: float, held: bool) -> None:
        self._turns.append((now, held))
        self._held += held
        if len(self._turns) > MAX_TURNS_REMEMBERED:
            self._forget_oldest()

    def share(self, now: float, window_s: float) -> float:
        """The share of the turns of the last ``window_s`` that were held; 0 with fewer
        than ``MIN_PRESSURE_TURNS`` of them (one held among a handful says nothing)."""
        turns, since = self._turns, now - window_s
        while turns and turns[0][0] < since:
            self._forget_oldest()
        if len(turns) < MIN_PRESSURE_TURNS:
            return 0.0
        return self._held / len(turns)

    def _forget_oldest(self) -> None:
        _, held = self._turns.popleft()
        self._held -= held
