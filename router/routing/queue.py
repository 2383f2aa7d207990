"""The router's queue: where a request waits while the worker chosen for it is full.

Arrival. A request's lifecycle asks the policy for a worker (``Router.choose``), counting
as queued on each worker the prefill the queue already holds for it. If that worker has
room and nothing is held for it, the request goes at once; otherwise it is held *for
that worker*, where its prefix is, rather than sent into the engine's first-come queue.

Room (``has_room``). A worker that has nothing outstanding takes anything. Otherwise it
is full when its uncached prefill dispatched and not yet started (this replica's and the
others', through the shared state) would take ``max_queued_prefill_s`` at its learned
speed; when the prompts it is running and this one would pass ``kv_budget`` of its KV
capacity (the engine would preempt, and recompute, rather than hold them); or at
``max_outstanding_per_worker`` requests, counting what the engine itself reports.

Release order. When a worker has room, the first of the requests held for it by: class
(interactive, then batch); a turn of a session under way before a session's first turn;
the client key with fewer requests in flight; the session
with fewer; the least prefill on that worker at its learned speed, less ``ageing`` for
each second waited; arrival. A turn whose prefix the worker holds has little prefill
and goes ahead of a long fresh prompt that would push out the prefixes of sessions about
to return; ageing keeps the long one from waiting for ever.

The door. A session's first turn (nothing of it cached, no work invested) goes at once
only while no turn of a session under way is held anywhere, and is released only then
(``door``): when the fleet is full for the sessions it has, new sessions wait and, past
their shorter deadline, are turned away, rather than adding dozens of turns each. With
``door_pressure`` the door also stays shut while that share of the turns under way of
the last ``door_window_s`` had to wait (``router.routing.door_pressure``).

Moving. A worker with room and nothing held for it looks at the requests held longest
for other workers (``MOVE_LOOKS`` of them): each is asked again where it would go,
counting what is held ahead of it; one that would now come here does.

Shedding. Held past its class's deadline (a first turn's is shorter: new sessions are
turned away at the door before sessions under way fail in their middle), or, with a
first-token target (``ttft_target_s``), once it could no longer start in time to meet
it (its own prefill at its worker's speed counted), or arriving to
a full queue (``queue_size`` requests or ``queue_bytes`` of bodies; an interactive
arrival displaces the newest held batch request first, where that makes room), a
request is refused with ``Shed`` (429; Anthropic's API: 529) and a ``Retry-After`` of
the time the queue needs to clear, before any engine spent anything on it. A client
that leaves while held just leaves the queue.

All of it runs on the event loop; nothing here awaits but the held request itself.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from router.auth import bearers, tenant
from router.clock import monotonic
from router.config import MAX_RETRY_AFTER_S, AdmissionConfig
from router.errors import Shed, ShedOverloaded
from router.fleet.workers import Fleet, Worker
from router.observability.queue_metrics import HoldReason, ShedReason
from router.routing.door_pressure import RecentWaits

# Held requests for other workers a worker with room looks at, oldest first, per pass.
MOVE_LOOKS = 8
# While anything is held, room is looked for at least this often: an engine's reported
# load and the learned speeds change without a request ending.
RECHECK_S = 0.05


class Waiter(Protocol):
    """A held request's lifecycle."""

    def rechoose(self, held_prefill: Mapping[str, int]) -> str | None:
        """The worker the request would go to now, counting ``held_prefill`` as queued
        there; None: no eligible worker."""

    def take(self, worker: str) -> bool:
        """Released: dispatch to ``worker`` now, so that the room is taken before the
        queue looks for more; False if it may no longer go there (it chooses again)."""


@dataclass(eq=False, slots=True)
class Held:
    waiter: Waiter
    target: str  # the worker it waits for
    priority: str
    first_turn: bool  # a session's first turn: nothing of it cached, no work invested
    prefill_tokens: int  # uncached on the target
    prompt_tokens: int
    body_bytes: int
    tenant: str | None
    session: str | None
    since: float
    seq: int
    released: asyncio.Future[str | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    expiry: asyncio.TimerHandle | None = None
    moved: bool = False  # released to another worker than it was held for


# (the settings as given, the publishing replica's version) -> the fleet's version for
# the change (router.replication.sync); raises a RouterError if it cannot be published.
SettingsPublisher = Callable[[Mapping[str, Any], int], Awaitable[int]]


class QueueObserver(Protocol):
    """What the queue tells its metrics (``router.observability.queue_metrics``)."""

    def admitted(self, priority: str, waited_s: float, moved: bool) -> None: ...

    def shed(self, priority: str, reason: ShedReason) -> None: ...

    def held(self, priority: str, reason: HoldReason) -> None: ...

    def abandoned(self, priority: str) -> None: ...


class RequestQueue:
    def __init__(
        self,
        limits: AdmissionConfig,
        fleet: Fleet,
        prefill_rate: Callable[[str], float],
        observer: QueueObserver,
    ) -> None:
        self._limits = limits
        self._batch_tenants: frozenset[str] = frozenset()
        self._fleet = fleet
        self._rate = prefill_rate
        self._observer = observer
        self._seq = itertools.count()
        self._held: dict[int, Held] = {}  # by seq: arrival order
        self._by_target: dict[str, dict[int, Held]] = {}
        self.held_prefill: dict[str, int] = {}  # per worker: uncached tokens held for it
        self.held_bytes = 0
        self._in_flight_tenants: Counter[str | None] = Counter()
        self._in_flight_sessions: Counter[str] = Counter()
        self._pump_soon: asyncio.Handle | None = None
        self._recheck: asyncio.TimerHandle | None = None
        self._moves_looked_at = float("-inf")
        self._held_under_way = 0  # held interactive turns of sessions under way
        self._recent_waits = RecentWaits()  # of turns of sessions under way
        self.limits = limits
        # Settings versions order changes as the policy's do (router.routing.policy_slot):
        # the configured ones are 0; with shared state Redis numbers the fleet's changes.
        self.settings_version = 0
        self.publisher: SettingsPublisher | None = None

    @property
    def limits(self) -> AdmissionConfig:
        return self._limits

    @limits.setter
    def limits(self, limits: AdmissionConfig) -> None:
        """New settings (the admin API's ``PUT /admin/admission``) apply to what is held
        from the next look on; held requests keep the deadlines they were given."""
        self._limits = limits
        digests = (tenant(key) for key in bearers(limits.batch_api_keys))
        self._batch_tenants = frozenset(d for d in digests if d is not None)
        if not limits.enabled:  # turned off: what is held goes as new requests now do
            for held in list(self._held.values()):
                self._release(held, None)
        self.notify()

    async def change(self, settings: Mapping[str, Any], limits: AdmissionConfig) -> None:
        """Number (fleet-wide through ``publisher``, when there is one) and install new
        settings: ``limits``, built from ``settings`` as given."""
        version = self.settings_version + 1
        if self.publisher is not None:
            version = await self.publisher(settings, self.settings_version)
        if not self.install(limits, version) and self.settings_version == version:
            # The fleet's copy of this very change came back first (while publishing):
            # it lacks this replica's own batch_api_keys, which the change carries.
            self.limits = limits

    def install(self, limits: AdmissionConfig, version: int) -> bool:
        """Make ``limits`` current if ``version`` is newer; False (nothing done) if not."""
        if version <= self.settings_version:
            return False
        self.settings_version = version
        self.limits = limits
        return True

    @property
    def enabled(self) -> bool:
        return self._limits.enabled

    def priority_of(self, tenant_: str | None, asked: bytes | None) -> str:
        """A request's class: batch if its client key is one of ``batch_api_keys`` or
        it asks for batch (``PRIORITY_HEADER``); a request cannot raise itself."""
        if asked is not None and asked.strip().lower() == b"batch":
            return "batch"
        return "batch" if tenant_ in self._batch_tenants else "interactive"

    def went_at_once(self, priority: str, first_turn: bool, session: str | None) -> None:
        self._observer.admitted(priority, 0.0, False)
        if _is_under_way(priority, first_turn, session):
            self._recent_waits.add(monotonic(), held=False)

    def depth(self, priority: str | None = None) -> int:
        if priority is None:
            return len(self._held)
        return sum(1 for h in self._held.values() if h.priority == priority)

    def held_for(self, worker: str) -> int:
        return len(self._by_target.get(worker, ()))

    def has_room(self, worker: Worker, prompt_tokens: int) -> bool:
        return self.full_by(worker, prompt_tokens) is None

    def full_by(self, worker: Worker, prompt_tokens: int) -> HoldReason | None:
        """Which room rule ``worker`` fails for a prompt of ``prompt_tokens``; None: it
        has room."""
        if worker.load == 0:
            return None
        limits = self.limits
        ceiling = limits.max_outstanding_per_worker
        if ceiling and worker.load >= ceiling:
            return "ceiling"
        queued = worker.queued_prefill_tokens + worker.remote_queued_prefill
        if queued >= limits.max_queued_prefill_s * self._rate(worker.name):
            return "prefill"
        running = worker.outstanding_tokens + worker.remote_tokens
        if running + prompt_tokens > limits.kv_budget * worker.capacity_tokens:
            return "kv"
        return None

    def goes_now(self, worker: Worker, prompt_tokens: int, first_turn: bool = False) -> bool:
        """A request chosen for ``worker`` goes at once: it has room, and nothing is held
        for it (what is held was there first and is ordered by the release rule). A
        session's first turn also waits while a turn of a session under way is held
        anywhere: the fleet is full for the sessions it has."""
        return self.hold_reason(worker, prompt_tokens, first_turn) is None

    def hold_reason(
        self, worker: Worker, prompt_tokens: int, first_turn: bool = False
    ) -> HoldReason | None:
        """Why a request chosen for ``worker`` would be held (``goes_now``'s answer,
        with its reason); None: it goes at once."""
        if first_turn and self._gate_closed():
            return "door"
        if self._may_go_for(worker.name):
            return "behind"  # new sessions waiting at a shut door are not ahead of it
        return self.full_by(worker, prompt_tokens)

    def _gate_closed(self) -> bool:
        """New sessions wait: an interactive turn of a session under way is held, or
        ``door_pressure`` of them lately were (``door``)."""
        limits = self.limits
        if not limits.door:
            return False
        if self._held_under_way > 0:
            return True
        if limits.door_pressure >= 1.0:
            return False
        return self._recent_waits.share(monotonic(), limits.door_window_s) >= limits.door_pressure

    def started(self, tenant: str | None, session: str | None) -> None:
        """A request passed the queue (at once or released): in flight until ``ended``."""
        self._in_flight_tenants[tenant] += 1
        if session is not None:
            self._in_flight_sessions[session] += 1

    def ended(self, tenant: str | None, session: str | None) -> None:
        """A request that ``started`` ended; room may have opened."""
        _drop(self._in_flight_tenants, tenant)
        if session is not None:
            _drop(self._in_flight_sessions, session)
        self.notify()

    async def hold(
        self,
        waiter: Waiter,
        target: str,
        priority: str,
        prefill_tokens: int,
        prompt_tokens: int,
        body_bytes: int,
        tenant: str | None,
        session: str | None,
        overloaded_status: bool = False,
        first_turn: bool = False,
        reason: HoldReason = "behind",
    ) -> None:
        """Wait until released: then the waiter has taken a worker, or (its worker gone)
        chooses again among all. Raises ``Shed`` (``ShedOverloaded`` with
        ``overloaded_status``) if let go."""
        now = monotonic()
        held = Held(
            waiter,
            target,
            priority,
            first_turn,
            prefill_tokens,
            prompt_tokens,
            body_bytes,
            tenant,
            session,
            now,
            next(self._seq),
        )
        refusal = self._make_room(held)
        if refusal is not None:
            self._observer.shed(priority, refusal)
            raise self._shed_error(refusal, overloaded_status)
        self._add(held)
        self._observer.held(priority, reason)
        if _under_way(held):
            self._recent_waits.add(monotonic(), held=True)
        loop = asyncio.get_running_loop()
        limits = self.limits
        why: ShedReason = "deadline"
        deadline = limits.deadline_s(priority, first_turn)
        slack = limits.target_slack_s(priority, prefill_tokens / max(self._rate(target), 1.0))
        if slack is not None and slack < deadline:
            deadline, why = slack, "ttft_target"
        held.expiry = loop.call_later(deadline, self._expire, held, why)
        self.notify()
        try:
            await held.released
        except asyncio.CancelledError:
            if held.seq in self._held:  # the client left while held
                self._remove(held)
                self._observer.abandoned(priority)
            raise
        except Shed as shed:
            raise self._shed_error(shed.reason, overloaded_status) from None
        self._observer.admitted(priority, monotonic() - now, held.moved)

    def notify(self) -> None:
        """Something changed (a request ended, a worker answered): look for room soon,
        once however many changes come before."""
        if self._held and self._pump_soon is None:
            self._pump_soon = asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        self._pump_soon = None
        if self._recheck is not None:
            self._recheck.cancel()
            self._recheck = None
        workers = self._fleet.workers
        for name in list(self._by_target):
            worker = workers.get(name)
            if worker is None or not worker.takes_requests():
                for held in list(self._by_target.get(name, {}).values()):
                    self._release(held, None)  # its worker is gone: it chooses again
                continue
            for held in sorted(self._by_target.get(name, {}).values(), key=self._release_key):
                if self._at_the_door(held):
                    continue  # new sessions wait; a batch turn under way behind may go
                if not self.has_room(worker, held.prompt_tokens):
                    break
                if not self._release(held, name):
                    break  # nothing was taken there: look again on the next pass
        self._move_to_idle(workers)
        if self._held:
            self._recheck = asyncio.get_running_loop().call_later(RECHECK_S, self._pump)

    def _move_to_idle(self, workers: Mapping[str, Worker]) -> None:
        """Workers with room and nothing held for them that may go now take requests
        that would now rather come to them (not new sessions while the door is closed).
        At most once each ``RECHECK_S``: every look asks the policy again for
        ``MOVE_LOOKS`` requests, and pumps come with every first byte."""
        now = monotonic()
        if now - self._moves_looked_at < RECHECK_S:
            return
        idle = [
            w
            for w in workers.values()
            if not self._may_go_for(w.name) and w.takes_requests() and self.has_room(w, 0)
        ]
        if not idle or not self._held:
            return
        self._moves_looked_at = now
        idle_names = {w.name for w in idle}
        candidates = (h for h in self._held.values() if not self._at_the_door(h))
        for held in list(itertools.islice(candidates, MOVE_LOOKS)):
            ahead = dict(self.held_prefill)
            ahead[held.target] -= held.prefill_tokens
            worker = held.waiter.rechoose(ahead)
            if worker is None or worker == held.target:
                continue
            if worker in idle_names and self.has_room(workers[worker], held.prompt_tokens):
                held.moved = True
                self._release(held, worker)

    def _at_the_door(self, held: Held) -> bool:
        return held.first_turn and self._gate_closed()

    def _may_go_for(self, worker: str) -> bool:
        """Something held for ``worker`` could go there now (not only new sessions at
        a closed door)."""
        held = self._by_target.get(worker, {})
        if not held or not self._gate_closed():
            return bool(held)
        return any(not h.first_turn for h in held.values())

    def _release_key(self, held: Held) -> tuple[int, bool, int, int, float, int]:
        rate = max(self._rate(held.target), 1.0)
        waited = monotonic() - held.since
        return (
            0 if held.priority == "interactive" else 1,
            held.first_turn,
            self._in_flight_tenants[held.tenant],
            self._in_flight_sessions[held.session] if held.session is not None else 0,
            held.prefill_tokens / rate - self.limits.ageing * waited,
            held.seq,
        )

    def _make_room(self, arriving: Held) -> ShedReason | None:
        """Room in the queue for ``arriving``, displacing held batch requests for an
        interactive one where that makes room; the reason it is refused, if it is."""
        limits = self.limits
        batch = [h for h in self._held.values() if h.priority == "batch"]
        if arriving.priority == "batch":
            batch = []  # a batch request displaces nobody
        count, size = len(self._held), self.held_bytes
        # Would displacing every held batch request make room? If not, displace none.
        if count - len(batch) >= limits.queue_size:
            return "queue_full"
        if size - sum(h.body_bytes for h in batch) + arriving.body_bytes > limits.queue_bytes:
            return "queue_bytes"
        for victim in reversed(batch):  # the newest first
            if len(self._held) < limits.queue_size and (
                self.held_bytes + arriving.body_bytes <= limits.queue_bytes
            ):
                break
            self._let_go(victim, "displaced")
        return None

    def _expire(self, held: Held, reason: ShedReason) -> None:
        if held.seq in self._held:
            self._let_go(held, reason)

    def _let_go(self, held: Held, reason: ShedReason) -> None:
        self._remove(held)
        self._observer.shed(held.priority, reason)
        if not held.released.done():
            held.released.set_exception(self._shed_error(reason, False))

    def _shed_error(self, reason: ShedReason | str, overloaded_status: bool) -> Shed:
        kind = ShedOverloaded if overloaded_status else Shed
        message = {
            "deadline": "no worker had room for this request within its queue deadline",
            "ttft_target": "no worker had room for this request in time to meet the "
            "first-token target",
            "queue_full": "the router's queue is full",
            "queue_bytes": "the router's queue holds as many request bytes as it may",
            "displaced": "a request of a higher priority class took this one's place",
        }.get(reason, "the router's queue let this request go")
        return kind(message, self._clear_time(), reason)

    def _clear_time(self) -> float:
        """Seconds until what is held now could have started: the longest worker's."""
        longest = max(
            (tokens / max(self._rate(name), 1.0) for name, tokens in self.held_prefill.items()),
            default=0.0,
        )
        return min(max(longest, self.limits.min_retry_after_s), MAX_RETRY_AFTER_S)

    def _add(self, held: Held) -> None:
        self._held[held.seq] = held
        self._by_target.setdefault(held.target, {})[held.seq] = held
        self.held_prefill[held.target] = self.held_prefill.get(held.target, 0) + (
            held.prefill_tokens
        )
        self.held_bytes += held.body_bytes
        if _under_way(held):
            self._held_under_way += 1

    def _remove(self, held: Held) -> None:
        del self._held[held.seq]
        targets = self._by_target[held.target]
        del targets[held.seq]
        if not targets:
            del self._by_target[held.target]
            del self.held_prefill[held.target]
        else:
            self.held_prefill[held.target] -= held.prefill_tokens
        self.held_bytes -= held.body_bytes
        if _under_way(held):
            self._held_under_way -= 1
        if held.expiry is not None:
            held.expiry.cancel()

    def _release(self, held: Held, worker: str | None) -> bool:
        """Out of the queue; on ``worker`` at once (None: it chooses again). True if it
        took ``worker``."""
        self._remove(held)
        if held.released.done():  # its client left in the meantime
            return False
        try:
            taken = worker is not None and held.waiter.take(worker)
        except Exception as exc:  # a policy's failure is this request's, not the queue's
            held.released.set_exception(exc)
            return False
        held.released.set_result(None)
        return taken


def _under_way(held: Held) -> bool:
    return _is_under_way(held.priority, held.first_turn, held.session)


def _is_under_way(priority: str, first_turn: bool, session: str | None) -> bool:
    """An interactive turn of a session under way: what closes the door. Batch work and
    requests of no session (one-shot completions) do not."""
    return priority == "interactive" and not first_turn and session is not None


K = TypeVar("K")


def _drop(counts: Counter[K], key: K) -> None:
    left = counts[key] - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
