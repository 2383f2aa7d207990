"""One client request from admission to its end, as the router sees it.

The relay (``router.edge.relay``) makes a ``RequestLifecycle`` for each parsed request
and asks it, in order: ``admit()`` (the model check is already done: an unknown model
never gets one), then, through ``router.routing.attempts.run_attempts``, ``dispatch()``
for each attempt, ``attempting()`` around its time on the worker, ``answered()`` and
``first_byte()`` as the worker answers, and exactly one of ``finished`` (the client saw
bytes: success, a refusal, a failure mid-stream, the client leaving) or ``failed``
(nothing reached the client; another worker may be tried); ``gave_up`` when no attempt
served it. The relay keeps the bytes; what a request did to the router's state (lease,
queued prefill, reserved blocks here and in the shared state, breaker, learning,
metrics) is settled here, through the ``Dispatch``, the ``Recorder`` and the shared
path.

With the router's queue on (``router.routing.queue``), ``admit()`` asks the policy for a
worker and either takes it at once or waits in the queue until released there (or
elsewhere, or let go: ``Shed``); the first attempt is then the dispatch the queue made.
Eligibility is computed once on the common path. A retry looks again (the worker that
failed is out, and health may have changed since) and does not queue again.

``PlainLifecycle`` is the same for a request with no prefix work (``router.edge.passthrough``):
the least loaded eligible worker, a lease, the breaker's verdict.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from policies.base import Outcome, RouteRequest
from router.apis.request import ClientRequest
from router.clock import monotonic
from router.errors import ModelNotFound, NoEligibleWorker
from router.fleet.workers import Lease, Worker
from router.routing.dispatch import Dispatch, EngineUsage, Router
from router.routing.queue import RequestQueue


class SharedPrefixes(Protocol):
    """The other replicas' view, read and written on the request path
    (``router.replication.path.SharedPath``)."""

    async def lookup(
        self, request: ClientRequest, hashes: Sequence[int], candidates: Sequence[Worker]
    ) -> dict[str, int] | None: ...

    async def reserve(self, worker: str, hashes: Sequence[int]) -> None: ...

    def withdraw(self, worker: str, hashes: Sequence[int]) -> None: ...


def eligible(
    router: Router, model: str | None, holder: Worker | None, tried: list[str]
) -> list[Worker]:
    """The workers a request may go to now: ``holder`` alone when it continues or reads
    a response stored there (draining or not, only it can; down, nobody can)."""
    if holder is None:
        return router.eligible(model, tried)
    usable = holder.healthy and holder.breaker.allows() and holder.name not in tried
    return [holder] if usable else []


def holder_unavailable(holder: Worker) -> NoEligibleWorker:
    return NoEligibleWorker(
        f"the worker that stored this response ({holder.name}) cannot take requests now"
    )


@dataclass(frozen=True, slots=True)
class QueueTerms:
    """What the router's queue weighs of a request besides its prompt."""

    priority: str = "interactive"
    tenant: str | None = None  # its client key (``router.auth.tenant``)
    body_bytes: int = 0
    overloaded_status: bool = False  # shed as overloaded (Anthropic's 529), not 429


class RequestLifecycle:
    __slots__ = (
        "_candidates",
        "_first",
        "_holder",
        "_queue",
        "_router",
        "_shared",
        "_started",
        "_terms",
        "arrived",
        "remote_matches",
        "request",
        "route",
        "tried",
    )

    def __init__(
        self,
        router: Router,
        queue: RequestQueue,
        request: ClientRequest,
        request_id: str,
        arrived: float,
        holder: Worker | None = None,
        shared: SharedPrefixes | None = None,
        terms: QueueTerms = QueueTerms(),
    ) -> None:
        if not router.fleet.serves(request.model):
            raise ModelNotFound(f"The model `{request.model}` does not exist.", param="model")
        self._router = router
        self._queue = queue
        self._terms = terms
        self._first: Dispatch | None = None  # the queue's dispatch, for the first attempt
        self._started = False  # passed the queue: in flight there until ``end``
        self._shared = shared
        self.request = request
        self.arrived = arrived
        router.learner.session_returns(request.session_key)
        self.route: RouteRequest = router.route_request(request, request_id)
        self.tried: list[str] = []  # workers whose attempt failed before the first byte
        self._candidates: list[Worker] | None = None
        # The one worker the request may go to (it continues a response stored there).
        self._holder = holder
        # Blocks of the prompt each worker holds according to the other replicas, when
        # asked (router.replication.path); None: the local index alone.
        self.remote_matches: dict[str, int] | None = None

    async def admit(self) -> None:
        """Returns when the request may be dispatched: at once without the queue, else
        when the queue released it (its first dispatch made); raises ``Shed`` if the
        queue let it go. With shared state, the other replicas' view of the prompt is
        read first."""
        if self._shared is not None:
            self.remote_matches = await self._shared.lookup(
                self.request, self.route.block_hashes, self.candidates()
            )
        queue = self._queue
        candidates = self.candidates()
        if not queue.enabled or not candidates:
            return  # without candidates, the dispatch says so
        choice = self._router.choose(
            self.route, candidates, self.remote_matches, queue.held_prefill
        )
        terms = self._terms
        reason = queue.hold_reason(choice.worker, self.route.prompt_tokens, self.route.first_turn)
        if reason is None:
            self._first = self._router.take(choice, self.request, 1, self.arrived)
            queue.went_at_once(terms.priority, self.route.first_turn, self.request.session_key)
        else:
            try:
                await queue.hold(
                    self,
                    choice.worker.name,
                    terms.priority,
                    choice.prefill_tokens,
                    self.route.prompt_tokens,
                    terms.body_bytes,
                    terms.tenant,
                    self.request.session_key,
                    terms.overloaded_status,
                    self.route.first_turn,
                    reason,
                )
            except asyncio.CancelledError:
                if self._first is not None:  # released as the client left
                    self._first.fail("client_disconnect")
                    self._first = None
                    queue.notify()
                raise
            self._candidates = None  # what was eligible before the wait may not be now
        self._started = True
        queue.started(terms.tenant, self.request.session_key)

    def rechoose(self, held_prefill: Mapping[str, int]) -> str | None:
        """Where the held request would go now (``router.routing.queue.Waiter``)."""
        candidates = eligible(self._router, self.request.model, self._holder, self.tried)
        if not candidates:
            return None
        choice = self._router.choose(self.route, candidates, self.remote_matches, held_prefill)
        return choice.worker.name

    def take(self, worker: str) -> bool:
        """Released to ``worker``: the first attempt's dispatch, made now. A worker no
        longer eligible is not taken: the first attempt chooses again."""
        candidates = eligible(self._router, self.request.model, self._holder, self.tried)
        chosen = [w for w in candidates if w.name == worker]
        if not chosen:
            return False
        choice = self._router.choose(self.route, chosen, self.remote_matches)
        self._first = self._router.take(choice, self.request, 1, self.arrived)
        return True

    def end(self) -> None:
        """The request is over, however it ended: it leaves the queue's in-flight count."""
        if self._started:
            self._started = False
            self._queue.ended(self._terms.tenant, self.request.session_key)

    def candidates(self) -> list[Worker]:
        """The workers the next dispatch chooses from (the admission check's, if fresh)."""
        if self._candidates is None:
            self._candidates = eligible(self._router, self.request.model, self._holder, self.tried)
        return self._candidates

    def dispatch(self) -> Dispatch:
        """The next attempt, on a worker not tried yet; raises ``NoEligibleWorker``."""
        if self._first is not None:
            first, self._first = self._first, None
            self._candidates = None  # a retry looks again, without the worker that failed
            return first
        candidates = self.candidates()
        self._candidates = None
        if not candidates and self._holder is not None:
            raise holder_unavailable(self._holder)
        if self.tried:
            self._router.recorder.retried(self.tried[-1])
        return self._router.dispatch(
            self.request, self.route, self.tried, self.arrived, candidates, self.remote_matches
        )

    @contextlib.asynccontextmanager
    async def attempting(
        self, dispatch: Dispatch, first_byte: asyncio.Timeout
    ) -> AsyncIterator[None]:
        """The attempt's time on its worker, until its answer is relayed: ``first_byte``
        (the caller's bound on the worker's silence) is given up on at once if the worker
        fails a health probe before it answers (``answered``); a whole reply's prompt
        stops counting as queued prefill once its prefill should be done; with shared
        state, the blocks it reserved are written first, where the other replicas read
        them."""
        unanswered = dispatch.worker.unanswered
        unanswered.add(first_byte)
        prefilled = (
            None
            if dispatch.request.stream
            else asyncio.get_running_loop().call_later(
                dispatch.expected_prefill_s(), dispatch.lease.prefill_done
            )
        )
        try:
            if self._shared is not None:
                await self._shared.reserve(dispatch.worker.name, dispatch.route.block_hashes)
            yield
        finally:
            unanswered.discard(first_byte)
            if prefilled is not None:
                prefilled.cancel()

    def answered(self, dispatch: Dispatch, first_byte: asyncio.Timeout) -> None:
        """The worker began to answer: a failed probe no longer gives the attempt up."""
        dispatch.worker.unanswered.discard(first_byte)

    def first_byte(self, dispatch: Dispatch, observe: bool = True, computed: bool = True) -> None:
        """The worker's first byte is in hand (``Dispatch.first_byte``)."""
        dispatch.first_byte(observe, computed)
        self._queue.notify()  # its prefill is no longer queued there: there may be room

    def failed(self, dispatch: Dispatch, outcome: Outcome) -> None:
        """The attempt failed before the client saw a byte."""
        dispatch.fail(outcome)
        self.tried.append(dispatch.worker.name)
        self._withdraw(dispatch)
        self._queue.notify()  # its lease is released: there is room now

    def finished(
        self,
        dispatch: Dispatch,
        outcome: Outcome,
        reply_hashes: tuple[int, ...] | list[int],
        usage: EngineUsage | None,
        reported_prompt_tokens: int | None,
    ) -> None:
        """The request ended on this attempt's worker, the client having seen bytes."""
        dispatch.finish(outcome, reply_hashes, usage, reported_prompt_tokens)
        if outcome != "success":  # refused, failed, abandoned: nothing new is there
            self._withdraw(dispatch)
        self._queue.notify()

    def _withdraw(self, dispatch: Dispatch) -> None:
        if self._shared is not None:
            self._shared.withdraw(dispatch.worker.name, dispatch.route.block_hashes)

    def gave_up(self, outcome: Outcome) -> None:
        """No attempt served the request; the last one ended as ``outcome``."""
        self._router.recorder.gave_up(
            self.request.model, self.request.kind, self.tried[-1], outcome
        )


class PlainLifecycle:
    """A request forwarded without prefix work: nothing enters the index or the
    learning, but its lease counts as load and its outcome reaches the breaker."""

    __slots__ = ("_holder", "_model", "_queue", "_router", "arrived", "tried")

    def __init__(
        self,
        router: Router,
        queue: RequestQueue,
        model: str | None,
        holder: Worker | None = None,
    ) -> None:
        if model is not None and not router.fleet.serves(model):
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        self._router = router
        self._queue = queue
        self._model = model
        self._holder = holder
        self.arrived = monotonic()
        self.tried: list[str] = []

    def dispatch(self) -> Lease:
        candidates = eligible(self._router, self._model, self._holder, self.tried)
        if not candidates:
            if self._holder is not None:
                raise holder_unavailable(self._holder)
            raise NoEligibleWorker("no healthy worker can take this request")
        return Lease(min(candidates, key=lambda w: (w.load, w.name)), 0, 0)

    def failed(self, lease: Lease, outcome: Outcome) -> None:
        lease.end(outcome)
        self.tried.append(lease.worker.name)
        self._queue.notify()  # its lease counted as load: there may be room now

    def finished(self, lease: Lease, outcome: Outcome) -> None:
        lease.end(outcome)
        self._queue.notify()

    def gave_up(self, outcome: Outcome) -> None:
        """Nothing to count: the client's answer says it."""
