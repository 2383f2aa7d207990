"""One client request from admission to its end, as the router sees it (no I/O here).

The proxy makes a ``RequestLifecycle`` for each parsed request and asks it, in order:
``admit()`` (the model check is already done: an unknown model never gets one), then
``dispatch()`` for each attempt, and for each attempt exactly one of ``finished`` (the
client saw bytes: success, a refusal, a failure mid-stream, the client leaving) or
``failed`` (nothing reached the client; another worker may be tried); ``gave_up`` when no
attempt served it. The proxy keeps the relay and the retry loop; what a request did to
the router's state (lease, reserved blocks, breaker, learning, metrics) is settled here,
through the ``Dispatch`` and the ``Recorder``.

Eligibility is computed once on the common path: the admission check's list of eligible
workers is the one the first dispatch chooses from. A retry looks again (the worker that
failed is out, and health may have changed since).
"""

from __future__ import annotations

from policies.base import Outcome, RouteRequest
from router.admission import Admission
from router.errors import ModelNotFound, NoEligibleWorker
from router.parse import ClientRequest
from router.routing import Dispatch, EngineUsage, Router
from router.workers import Worker


class RequestLifecycle:
    __slots__ = (
        "_admission",
        "_candidates",
        "_holder",
        "_router",
        "arrived",
        "remote_matches",
        "request",
        "route",
        "tried",
    )

    def __init__(
        self,
        router: Router,
        admission: Admission,
        request: ClientRequest,
        request_id: str,
        arrived: float,
        holder: Worker | None = None,
    ) -> None:
        if not router.fleet.serves(request.model):
            raise ModelNotFound(f"The model `{request.model}` does not exist.", param="model")
        self._router = router
        self._admission = admission
        self.request = request
        self.arrived = arrived
        self.route: RouteRequest = router.route_request(request, request_id)
        self.tried: list[str] = []  # workers whose attempt failed before the first byte
        self._candidates: list[Worker] | None = None
        # The one worker the request may go to (it continues a response stored there).
        self._holder = holder
        # Blocks of the prompt each worker holds according to the other replicas, when
        # the proxy asked (router.shared.path); None: the local index alone.
        self.remote_matches: dict[str, int] | None = None

    async def admit(self) -> None:
        """Returns when some eligible worker has room (at once without admission limits);
        raises ``TooManyRequests`` or ``Overloaded`` if none gets room in time."""
        await self._admission.wait_for_room(self._has_room)

    def _has_room(self) -> bool:
        self._candidates = self._eligible()
        return Router.room_among(self._candidates, self._admission.limit)

    def _eligible(self) -> list[Worker]:
        holder = self._holder
        if holder is None:
            return self._router.eligible(self.request.model, self.tried)
        # Draining or not, only it can serve the request; down, nobody can.
        usable = holder.healthy and holder.breaker.allows() and holder.name not in self.tried
        return [holder] if usable else []

    def candidates(self) -> list[Worker]:
        """The workers the next dispatch chooses from (the admission check's, if fresh)."""
        if self._candidates is None:
            self._candidates = self._eligible()
        return self._candidates

    def dispatch(self) -> Dispatch:
        """The next attempt, on a worker not tried yet; raises ``NoEligibleWorker``."""
        candidates, self._candidates = self._candidates, None
        if candidates is None:
            candidates = self._eligible()
        if not candidates and self._holder is not None:
            raise NoEligibleWorker(
                f"the worker that stored this response ({self._holder.name}) cannot take "
                "requests now"
            )
        if self.tried:
            self._router.recorder.retried(self.tried[-1])
        return self._router.dispatch(
            self.request, self.route, self.tried, self.arrived, candidates, self.remote_matches
        )

    def failed(self, dispatch: Dispatch, outcome: Outcome) -> None:
        """The attempt failed before the client saw a byte."""
        dispatch.fail(outcome)
        self.tried.append(dispatch.worker.name)
        self._admission.notify()  # its lease is released: there is room now

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
        self._admission.notify()

    def gave_up(self, outcome: Outcome) -> None:
        """No attempt served the request; the last one ended as ``outcome``."""
        self._router.recorder.gave_up(
            self.request.model, self.request.kind, self.tried[-1], outcome
        )
