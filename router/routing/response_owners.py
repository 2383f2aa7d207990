"""Which worker stored each Responses response: where a request continuing it
(``previous_response_id``), and a ``GET`` or ``cancel`` of it, must go.

An engine keeps its stored responses in its own process (vLLM: in memory, lost on a
restart), and a response id says nothing of which engine holds it. So the router
remembers, from each reply it relays, ``id -> (worker, the engine's start time)``; a
response whose worker is gone, or whose engine restarted since, is answered as the engine
would answer it, a 404, rather than sent where it was never stored. The map is a bounded
LRU; with shared state, each entry is also written to Redis (``SharedPath``), so any
replica finds the response whichever one relayed it.

With ``api_keys``, a response belongs to the key that created it (``router.auth.tenant``):
to every other key it is answered as a response that does not exist, 404.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from router.errors import ResponseNotFound
from router.fleet.workers import Fleet, Worker

DEFAULT_MAX_RESPONSES = 100_000


_TENANT_SEPARATOR = "\n"  # after the worker: no worker name or digest holds one


@dataclass(frozen=True, slots=True)
class Owner:
    worker: str
    engine_started_at: float | None  # None: not known when it was stored
    tenant: str | None = None  # the key that created it (a digest); None: any client's

    @classmethod
    def of(cls, worker: Worker, tenant: str | None = None) -> Owner:
        return cls(worker.name, worker.engine_started_at, tenant)

    def encode(self) -> str:
        owner = f"{self.engine_started_at or ''} {self.worker}"
        return owner if self.tenant is None else owner + _TENANT_SEPARATOR + self.tenant

    @classmethod
    def decode(cls, text: str) -> Owner | None:
        owner, _, tenant = text.partition(_TENANT_SEPARATOR)
        started, _, worker = owner.partition(" ")
        try:
            started_at = float(started) if started else None
        except ValueError:
            return None
        return cls(worker, started_at, tenant or None) if worker else None

    def reachable_by(self, tenant: str | None) -> bool:
        return self.tenant is None or self.tenant == tenant

    def holder(self, fleet: Fleet) -> Worker | None:
        """The worker, if it still holds what it stored: in the fleet, not restarted."""
        worker = fleet.workers.get(self.worker)
        if worker is None:
            return None
        then, now = self.engine_started_at, worker.engine_started_at
        if then is not None and now is not None and then != now:
            return None
        return worker


class ResponseOwners:
    """The bounded local map; ``router.replication.path.SharedPath`` shares it."""

    def __init__(self, max_entries: int = DEFAULT_MAX_RESPONSES) -> None:
        self._max = max_entries
        self._owners: OrderedDict[str, Owner] = OrderedDict()

    def remember(self, response_id: str, owner: Owner) -> None:
        owners = self._owners
        owners[response_id] = owner
        owners.move_to_end(response_id)
        if len(owners) > self._max:
            owners.popitem(last=False)

    def get(self, response_id: str) -> Owner | None:
        owner = self._owners.get(response_id)
        if owner is not None:
            self._owners.move_to_end(response_id)
        return owner

    def __len__(self) -> int:
        return len(self._owners)


class OwnerLookup(Protocol):
    """Where other replicas' entries are found (``SharedPath``)."""

    async def response_owner(self, response_id: str) -> Owner | None: ...


async def holder_of(
    response_id: str,
    tenant: str | None,
    owners: ResponseOwners,
    fleet: Fleet,
    shared: OwnerLookup | None,
) -> Worker:
    """The worker holding ``response_id`` for ``tenant``; ``ResponseNotFound`` where none
    does, or the response is another tenant's."""
    owner = owners.get(response_id)
    if owner is None and shared is not None:
        owner = await shared.response_owner(response_id)
        if owner is not None:
            owners.remember(response_id, owner)
    if owner is not None and not owner.reachable_by(tenant):
        owner = None
    worker = owner.holder(fleet) if owner is not None else None
    if worker is None:
        raise ResponseNotFound(response_id)
    return worker
