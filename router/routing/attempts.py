"""Every attempt a request makes on a worker, run by one loop (``run_attempts``) for the
keyed routes (``router.edge.relay``) and the passthrough ones (``router.edge.passthrough``) alike.

An attempt that fails before the client saw a byte raises ``AttemptFailed``; its
lifecycle hears of it (lease, breaker, what the request reserved) and the next worker
is tried while ``Retry`` allows it: at most ``max_attempts`` workers, none begun past
``deadline_s`` after the request arrived, each after a wait that doubles
(``router.backoff``; none by default: it is another worker). When none is
left the lifecycle gives up and the last ``AttemptFailed`` is raised: its ``fallback``
(the last worker's own 5xx) or its error is the client's answer
(``router.edge.relay.answer_failure``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from policies.base import Outcome
from router.backoff import Backoff
from router.clock import monotonic
from router.config import UpstreamConfig
from router.errors import NoEligibleWorker, RouterError, UpstreamTimeout
from router.fleet.workers import Worker

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Retry:
    max_attempts: int
    deadline_s: float  # after the request arrived, no attempt begins
    backoff_s: float = 0.0  # the first wait before another worker (0: none), then doubling

    @classmethod
    def of(cls, config: UpstreamConfig) -> Retry:
        return cls(config.max_attempts, config.retry_deadline_s, config.retry_backoff_s)

    def backoff(self) -> Backoff | None:
        """One request's waits between its attempts; None: the next worker at once."""
        return Backoff(self.backoff_s, self.deadline_s) if self.backoff_s > 0 else None

    def delay_before_next(
        self, failures: int, elapsed_s: float, backoff: Backoff | None
    ) -> float | None:
        """Seconds to wait before another attempt, or None when there is to be none."""
        if failures >= self.max_attempts:
            return None
        delay = 0.0 if backoff is None else backoff.next()
        return None if elapsed_s + delay > self.deadline_s else delay


@dataclass(frozen=True, slots=True)
class Fallback:
    """A worker's own error answer, passed on if no other worker can be tried."""

    status: int
    body: bytes
    content_type: bytes


class AttemptFailed(Exception):
    """The attempt failed before the client saw a byte; another worker may be tried."""

    def __init__(self, error: RouterError, fallback: Fallback | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.fallback = fallback

    @property
    def outcome(self) -> Outcome:
        return "timeout" if isinstance(self.error, UpstreamTimeout) else "upstream_error"


class Dispatched(Protocol):
    @property
    def worker(self) -> Worker: ...


D = TypeVar("D", bound=Dispatched)
D_co = TypeVar("D_co", bound=Dispatched, covariant=True)


class Lifecycle(Protocol[D_co]):
    """What the loop asks of a request's lifecycle (``router.routing.lifecycle``)."""

    @property
    def arrived(self) -> float: ...

    def dispatch(self) -> D_co:
        """The next attempt, on a worker not tried yet; raises ``NoEligibleWorker``."""
        ...

    def gave_up(self, outcome: Outcome) -> None: ...


async def run_attempts(
    lifecycle: Lifecycle[D],
    retry: Retry,
    attempt: Callable[[D], Awaitable[None]],
    request_id: str,
) -> None:
    """Runs ``attempt`` on one worker after another until one serves the request;
    raises the last ``AttemptFailed`` if none did."""
    failures = 0
    backoff = retry.backoff()
    last: AttemptFailed | None = None
    while True:
        try:
            dispatched = lifecycle.dispatch()
        except NoEligibleWorker:
            if last is None:
                raise
            break
        try:
            await attempt(dispatched)
            return
        except AttemptFailed as failed:
            last = failed
            failures += 1
            log.warning(
                "request %s failed on %s before the first byte: %s",
                request_id,
                dispatched.worker.name,
                failed.error.message,
            )
        delay = retry.delay_before_next(failures, monotonic() - lifecycle.arrived, backoff)
        if delay is None:
            break
        if delay > 0:
            await asyncio.sleep(delay)
    assert last is not None
    lifecycle.gave_up(last.outcome)
    raise last
