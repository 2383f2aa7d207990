"""The routing decision and its bookkeeping, free of I/O.

``Router.dispatch`` looks up every eligible worker's match in the prefix index, lets the
policy choose, takes a load ``Lease`` and reserves the prompt's blocks on the chosen
worker at once (siblings arriving next find them; nothing is evicted for them yet). The
first byte means the worker computed them: they are recorded then (``first_byte``).
``Dispatch.finish`` releases the lease exactly once and, on success, extends the worker's
entries with the reply so the session's next turn matches its whole history, and hands
what the engine reported to the ``Learner`` (router.routing.learning); a dispatch that failed or
was refused releases its reservation and leaves the model as it was. A ``Dispatch``
holds the index and the recorder, not the ``Router`` that made it. Which workers exist
is ``router.routing.membership``'s; what becomes of a request, ``router.routing.lifecycle``'s.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from policies.base import Decision, Outcome, Policy, RouteRequest, WorkerView
from router.apis.request import ClientRequest
from router.clock import monotonic
from router.config import BYTES_PER_TOKEN_ESTIMATE
from router.errors import NoEligibleWorker
from router.fleet.workers import Fleet, Lease, Worker
from router.index.engine_blocks import whole_engine_blocks
from router.index.residency import PrefixIndex
from router.observability.metrics import RouterMetrics
from router.routing.learning import Learner
from router.routing.policy_slot import ActivePolicy, PolicySlot
from router.routing.recorder import Recorder
from router.wire.kinds import TurnEnd


@dataclass(frozen=True, slots=True)
class EngineUsage:
    """What the engine reported for a finished request."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int = 0


@dataclass(slots=True)
class Dispatch:
    """One attempt to serve a request on one worker."""

    index: PrefixIndex
    recorder: Recorder  # hears how the request went
    # The policy that chose the worker: it hears the outcome even if the router's current
    # policy has changed since (an in-flight request is not the new policy's business).
    policy: Policy
    request: ClientRequest
    route: RouteRequest
    worker: Worker
    decision: Decision
    lease: Lease
    queued_before: int  # prefill tokens queued on the worker ahead of this request
    best_match: int  # the most of this prompt any eligible worker was modelled to hold
    arrived: float  # when the client's request arrived (monotonic)
    attempt: int  # 1 for the first worker tried, 2 for the retry after it, ...
    matched: int = 0  # tokens of the prompt the worker's GPU was modelled to hold
    # Of the prompt beyond that, the tokens its CPU tier held.
    offloaded: int = 0
    sent_at: float = field(default_factory=monotonic)
    ttft: float | None = None
    done: bool = False
    reserved: bool = True  # the prompt's blocks are reserved, not yet recorded
    turn_end: TurnEnd = "user"  # what the reply leaves the session waiting on

    def expected_prefill_s(self) -> float:
        """When the worker should have prefilled this request: the queue found ahead of
        it and its own uncached tokens, at the worker's learned speed."""
        rate = self.recorder.learner.prefill_tokens_per_s(self.worker.name)
        return (self.queued_before + self.lease.prefill_tokens) / max(rate, 1.0)

    def _record_prompt(self) -> None:
        """The worker computed the prompt: its blocks move from reserved to recorded."""
        if self.reserved:
            self.reserved = False
            hashes = self.route.block_hashes
            self.index.touch(self.worker.name, hashes)
            self.index.release(self.worker.name, hashes)

    def _withdraw_prompt(self) -> None:
        if self.reserved:
            self.reserved = False
            self.index.release(self.worker.name, self.route.block_hashes)

    def first_byte(self, observe: bool = True, computed: bool = True) -> float:
        """The worker answered: its prefill of this request is done (``computed``: it
        prefilled the prompt, which a refusal does not). Returns the time since dispatch;
        ``observe`` keeps it as this request's TTFT."""
        elapsed = monotonic() - self.sent_at
        self.lease.prefill_done()
        if computed:
            self._record_prompt()
        if observe:
            self.ttft = elapsed
            self.recorder.first_byte(self, elapsed)
        return elapsed

    def fail(self, outcome: Outcome) -> None:
        """The attempt failed before the client saw a byte (it may be retried elsewhere):
        nothing reached the worker's cache, the reservation is withdrawn."""
        if self._end(outcome):
            self._withdraw_prompt()

    def finish(
        self,
        outcome: Outcome,
        reply_hashes: tuple[int, ...] | list[int],
        usage: EngineUsage | None = None,
        reported_prompt_tokens: int | None = None,
    ) -> None:
        """The request ended on this worker: the recorder hears how."""
        if not self._end(outcome):
            return
        if outcome == "success" and reply_hashes:
            # The whole history, most recent at the end, as the engine frees it; this
            # records the prompt too if its first byte did not already.
            self.index.touch(self.worker.name, (*self.route.block_hashes, *reply_hashes))
        elif outcome in ("success", "client_disconnect"):
            self._record_prompt()  # on a disconnect the worker may have computed it
        self._withdraw_prompt()  # what is still reserved: refused, or failed before
        self.recorder.finished(self, outcome, usage, reported_prompt_tokens)

    def _end(self, outcome: Outcome) -> bool:
        """Lease, breaker and policy, exactly once; False if already ended."""
        if self.done:
            return False
        self.done = True
        self.lease.end(outcome)
        self.policy.on_complete(self.route, self.worker.name, outcome)
        return True


@dataclass(frozen=True, slots=True)
class Choice:
    """Where the policy would send a request, before anything is taken there."""

    active: ActivePolicy
    route: RouteRequest
    worker: Worker
    decision: Decision
    matched: int  # tokens of the prompt the worker is modelled to hold
    best_match: int  # the most any candidate was modelled to hold
    started: float  # perf_counter when the choice began (the decision's time)
    offloaded: int = 0  # tokens beyond ``matched`` the worker holds in its CPU tier

    @property
    def prefill_tokens(self) -> int:
        """The prompt's tokens the worker would compute, as the policy priced them (a
        CPU-tier hit it credited is read back, not computed; one it did not, counted)."""
        held = max(self.matched, self.decision.predicted_cached_tokens)
        return max(0, self.route.prompt_tokens - held)


class Router:
    def __init__(
        self,
        fleet: Fleet,
        index: PrefixIndex,
        policies: PolicySlot,
        block_tokens: int,
        metrics: RouterMetrics,
        stale_after_s: float | None = None,
        log_requests: bool = False,
        reload_tokens_per_s: float = 0.0,
    ) -> None:
        self.fleet = fleet
        self.stale_after_s = stale_after_s
        # How fast a worker reads its CPU tier back (router.planning.reload; 0: unknown).
        self.reload_tokens_per_s = reload_tokens_per_s
        self.index = index
        self.policies = policies
        self.block_tokens = block_tokens
        self.metrics = metrics
        self.learner = Learner(fleet, index, metrics, block_tokens)
        self.recorder = Recorder(fleet, metrics, self.learner, log_requests)

    def route_request(self, request: ClientRequest, request_id: str) -> RouteRequest:
        return RouteRequest(
            request_id=request_id,
            model=request.model,
            session_key=request.session_key,
            block_hashes=request.key.hashes,
            block_tokens=self.block_tokens,
            prompt_tokens=max(1, -(-request.key.total_bytes // BYTES_PER_TOKEN_ESTIMATE)),
            first_turn=request.first_turn,
            parent_worker=self.learner.worker_of(request.parent_session),
        )

    def eligible(self, model: str | None, exclude: list[str]) -> list[Worker]:
        """The workers that may take a request for ``model`` now, but those in ``exclude``."""
        return self.fleet.eligible(model, exclude, self.stale_after_s)

    def dispatch(
        self,
        request: ClientRequest,
        route: RouteRequest,
        exclude: list[str],
        arrived: float | None = None,
        candidates: list[Worker] | None = None,
        remote_matches: Mapping[str, int] | None = None,
    ) -> Dispatch:
        """Choose a worker for ``request`` among ``candidates`` (default: the eligible
        ones not in ``exclude``, the ones tried already) and take what the dispatch holds
        until it ends. ``remote_matches``: blocks of the prompt each worker holds as the
        other replicas have it (read from Redis), where that is more than the local
        index knows."""
        if candidates is None:
            candidates = self.eligible(request.model, exclude)
        choice = self.choose(route, candidates, remote_matches)
        return self.take(choice, request, len(exclude) + 1, arrived)

    def choose(
        self,
        route: RouteRequest,
        candidates: list[Worker],
        remote_matches: Mapping[str, int] | None = None,
        held_prefill: Mapping[str, int] | None = None,
    ) -> Choice:
        """The policy's choice among ``candidates``, nothing taken yet. ``held_prefill``:
        uncached prompt tokens the router's queue holds for each worker, counted as
        queued there (``router.routing.queue``)."""
        started = time.perf_counter()
        if not candidates:
            raise NoEligibleWorker(f"no healthy worker serves model {route.model!r}")
        now = monotonic()
        active = self.policies.current  # read once: one policy chooses and hears the end
        returns = active.policy.counts_returns
        views = [self._view(w, route, now, remote_matches, returns) for w in candidates]
        if held_prefill:
            views = [
                v._replace(queued_prefill_tokens=v.queued_prefill_tokens + held_prefill[v.name])
                if v.name in held_prefill
                else v
                for v in views
            ]
        decision = active.policy.choose(route, views)
        chosen = next(v for v in views if v.name == decision.worker)
        best = max(v.matched_tokens for v in views)
        return Choice(
            active,
            route,
            self.fleet.workers[decision.worker],
            decision,
            chosen.matched_tokens,
            best,
            started,
            chosen.offloaded_tokens,
        )

    def take(
        self, choice: Choice, request: ClientRequest, attempt: int, arrived: float | None = None
    ) -> Dispatch:
        """Send ``request`` where ``choice`` says: its lease, its blocks reserved there."""
        route, worker, active = choice.route, choice.worker, choice.active
        now = monotonic()
        queued_before = worker.queued_prefill_tokens
        lease = Lease(worker, route.prompt_tokens, choice.prefill_tokens)
        worker.demand.add(route.prompt_tokens, now)
        self.index.reserve(worker.name, route.block_hashes)
        active.policy.on_dispatch(route, worker.name)
        metrics = self.metrics
        metrics.decision_seconds.observe(time.perf_counter() - choice.started)
        metrics.counter(metrics.decisions, active.name, choice.decision.reason).inc()
        series = metrics.worker(worker.name)
        series.best_cached_tokens.inc(choice.best_match)
        series.predicted_cached_tokens.inc(choice.matched)
        series.predicted_offloaded_tokens.inc(choice.offloaded)
        return Dispatch(
            self.index,
            self.recorder,
            active.policy,
            request,
            route,
            worker,
            choice.decision,
            lease,
            queued_before,
            choice.best_match,
            now if arrived is None else arrived,
            attempt,
            choice.matched,
            choice.offloaded,
        )

    @staticmethod
    def room_among(candidates: list[Worker], limit: int) -> bool:
        """Some of ``candidates`` has fewer than ``limit`` requests outstanding."""
        return any(w.load < limit for w in candidates)

    def _view(
        self,
        worker: Worker,
        route: RouteRequest,
        now: float,
        remote_matches: Mapping[str, int] | None = None,
        counts_returns: bool = False,
    ) -> WorkerView:
        matched_blocks = self.index.match(worker.name, route.block_hashes)
        if remote_matches is not None:
            matched_blocks = max(matched_blocks, remote_matches.get(worker.name, 0))
        matched = whole_engine_blocks(
            min(route.prompt_tokens, matched_blocks * self.block_tokens),
            worker.engine_block_tokens,
        )
        offloaded = 0
        beyond = self.index.offloaded_continuation(worker.name, route.block_hashes, matched_blocks)
        if beyond:
            held = min(route.prompt_tokens, (matched_blocks + beyond) * self.block_tokens)
            offloaded = whole_engine_blocks(held, worker.engine_block_tokens) - matched
        resident = self.index.resident_blocks(worker.name) * self.block_tokens
        returning = 0.0
        if counts_returns:
            modelled = self.learner.modelled_capacity(worker)
            evicted = resident + route.prompt_tokens - matched - modelled
            returning = self.learner.returning_tokens(worker.name, evicted, now)
        return WorkerView(
            name=worker.name,
            outstanding_requests=worker.load,
            outstanding_tokens=worker.outstanding_tokens + worker.remote_tokens,
            queued_prefill_tokens=worker.queued_prefill_tokens + worker.remote_queued_prefill,
            matched_tokens=matched,
            resident_tokens=resident,
            capacity_tokens=worker.capacity_tokens,
            prefill_tokens_per_s=self.learner.prefill_tokens_per_s(worker.name),
            recent_prompt_tokens=worker.demand.value(now) + worker.remote_demand.value(now),
            cache_block_tokens=worker.engine_block_tokens or 0,
            returning_evicted_tokens=returning,
            offloaded_tokens=offloaded,
            reload_tokens_per_s=self.reload_tokens_per_s,
        )
