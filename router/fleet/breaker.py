"""A circuit breaker per worker, fed by request outcomes.

A worker that fails requests while its ``/health`` still answers (a broken model, a full
disk, an OOM loop) fails fast, so it looks idle, and load-seeking policies would send it
everything. The breaker takes it out instead:

    closed --(failure_threshold consecutive failures)--> open
    open --(cooldown elapsed)--> half-open: one trial request is let through
    half-open --trial succeeds--> closed
    half-open --trial fails--> open again, cooldown doubled (up to max_cooldown_s)

Only upstream failures count (connection errors, 5xx, timeouts); a client that goes away
or a 4xx for a bad request says nothing about the worker. Only requests sent since the
circuit last opened count: ``on_dispatch`` hands out a ticket naming that opening, and an
outcome whose ticket is older is ignored (a request sent before the worker broke, ending
after, must not close the circuit or fail the trial).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum

from policies.base import Outcome
from router.clock import monotonic
from router.config import (
    DEFAULT_COOLDOWN_S,
    DEFAULT_FAILURE_THRESHOLD,
    DEFAULT_MAX_COOLDOWN_S,
)


class BreakerState(IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    __slots__ = (
        "_clock",
        "_cooldown",
        "_failures",
        "_opened_at",
        "_openings",
        "_trial_out",
        "cooldown_s",
        "failure_threshold",
        "max_cooldown_s",
        "state",
    )

    def __init__(
        self,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        max_cooldown_s: float = DEFAULT_MAX_COOLDOWN_S,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self._clock = clock
        self.state = BreakerState.CLOSED
        self._failures = 0
        self._cooldown = cooldown_s
        self._opened_at = 0.0
        self._openings = 0
        self._trial_out = False

    def allows(self) -> bool:
        """May a request be sent now? (Moves open -> half-open when the cooldown is over.)"""
        if self._cooled_down():
            self.state = BreakerState.HALF_OPEN
            self._trial_out = False
        if self.state is BreakerState.HALF_OPEN:
            return not self._trial_out
        return self.state is BreakerState.CLOSED

    @property
    def reported_state(self) -> BreakerState:
        """What the next request would meet, for operators: an open circuit whose cooldown
        is over is half-open (``state`` moves only when a request asks)."""
        return BreakerState.HALF_OPEN if self._cooled_down() else self.state

    def _cooled_down(self) -> bool:
        return self.state is BreakerState.OPEN and self._clock() - self._opened_at >= self._cooldown

    def on_dispatch(self) -> int:
        """A request was sent; returns its ticket for the outcome."""
        if self.state is BreakerState.HALF_OPEN:
            self._trial_out = True
        return self._openings

    def on_success(self, ticket: int) -> None:
        if ticket != self._openings:
            return  # sent before the circuit last opened
        self.state = BreakerState.CLOSED
        self._failures = 0
        self._cooldown = self.cooldown_s
        self._trial_out = False

    def on_failure(self, ticket: int) -> None:
        if ticket != self._openings:
            return
        if self.state is BreakerState.HALF_OPEN:
            self._cooldown = min(self.max_cooldown_s, self._cooldown * 2)
            self._open()
            return
        self._failures += 1
        if self.state is BreakerState.CLOSED and self._failures >= self.failure_threshold:
            self._open()

    def on_outcome(self, ticket: int, outcome: Outcome) -> None:
        """How a request sent with ``ticket`` ended: a refusal (4xx) is the request's
        fault, not the worker's; a client that left says nothing either way."""
        if outcome in ("success", "rejected"):
            self.on_success(ticket)
        elif outcome == "client_disconnect":
            self.on_abandoned(ticket)
        else:
            self.on_failure(ticket)

    def on_abandoned(self, ticket: int) -> None:
        """The request ended without a verdict (the client left): free the trial slot."""
        if ticket == self._openings:
            self._trial_out = False

    def _open(self) -> None:
        self._openings += 1
        self.state = BreakerState.OPEN
        self._opened_at = self._clock()
        self._trial_out = False
