"""Which worker stored each Responses response: where a request continuing it
(``previous_response_id``), and a ``GET`` or ``cancel`` of it, must go.

An engine keeps its stored responses in its own process (vLLM: in memory, lost on a
restart), and a response id says nothing of which engine holds it. So the router
remembers, from each reply it relays, ``id -> (worker, the engine's start time)``; a
response whose worker is gone, or whose engine restarted since, is answered as the engine
would answer it, a 404, rather than sent where it was never stored. The map is a bounded
LRU; with shared state, each entry is also written to Redis (``SharedPath``), so any
replica finds the response whichever one relayed it.

With the owner, where it is known, the response's conversation as a chain
(``router.index.stored_chain``): a request continuing it is keyed as that conversation
followed by its input. Chains are bounded twice: each by its blocks, all of them by
their bytes (the least recently used dropped first, its owner kept: the request
continuing it is then keyed blind, as one whose chain was never known). A chain is
reached only through its owner, so only by the key that created the response.

With ``api_keys``, a response belongs to the key that created it (``router.auth.tenant``):
to every other key it is answered as a response that does not exist, 404.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from router.errors import ResponseNotFound
from router.fleet.workers import Fleet, Worker
from router.index.stored_chain import StoredChain

DEFAULT_MAX_RESPONSES = 100_000
# The chains' hashes and tails, at most: 4,096 conversations of 64K tokens each (16
# tokens a block, 8 bytes a hash), or 1,024 at the bound on one chain
# (router.index.stored_chain.MAX_CHAIN_BLOCKS).
DEFAULT_MAX_CHAIN_BYTES = 128 * 1024 * 1024
# What an entry costs beyond its bytes (the object, the map's slot), charged against
# the bound, so that a flood of short chains is bounded too.
CHAIN_OVERHEAD_BYTES = 256


_TENANT_SEPARATOR = "\n"  # after the worker: no worker name or digest holds one


# An owner's encoding (a start time, a worker's name, a tenant's digest) is far shorter;
# a longer value in Redis is no owner a replica wrote, and is read no further.
MAX_OWNER_BYTES = 4096


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

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_RESPONSES,
        max_chain_bytes: int = DEFAULT_MAX_CHAIN_BYTES,
    ) -> None:
        self._max = max_entries
        self._max_chain_bytes = max_chain_bytes
        self._owners: OrderedDict[str, Owner] = OrderedDict()
        self._chains: OrderedDict[str, StoredChain] = OrderedDict()
        self._chain_bytes = 0  # charged: each chain's size and CHAIN_OVERHEAD_BYTES

    def remember(self, response_id: str, owner: Owner, chain: StoredChain | None = None) -> None:
        owners = self._owners
        owners[response_id] = owner
        owners.move_to_end(response_id)
        self._forget_chain(response_id)
        if chain is not None:
            self._chains[response_id] = chain
            self._chain_bytes += _charge(chain)
        if len(owners) > self._max:
            dropped, _ = owners.popitem(last=False)
            self._forget_chain(dropped)
        while self._chain_bytes > self._max_chain_bytes and self._chains:
            _, oldest = self._chains.popitem(last=False)
            self._chain_bytes -= _charge(oldest)

    def get(self, response_id: str) -> Owner | None:
        owner = self._owners.get(response_id)
        if owner is not None:
            self._owners.move_to_end(response_id)
        return owner

    def chain(self, response_id: str) -> StoredChain | None:
        """The response's conversation, if known here; ask after its owner (``get``)."""
        chain = self._chains.get(response_id)
        if chain is not None:
            self._chains.move_to_end(response_id)
        return chain

    @property
    def chain_bytes(self) -> int:
        return self._chain_bytes

    def _forget_chain(self, response_id: str) -> None:
        chain = self._chains.pop(response_id, None)
        if chain is not None:
            self._chain_bytes -= _charge(chain)

    def __len__(self) -> int:
        return len(self._owners)


def _charge(chain: StoredChain) -> int:
    return chain.size_bytes + CHAIN_OVERHEAD_BYTES


class OwnerLookup(Protocol):
    """Where other replicas' entries are found (``SharedPath``)."""

    async def stored_response(self, response_id: str) -> tuple[Owner | None, StoredChain | None]:
        """The owner and, where it was written with one, the conversation's chain."""


@dataclass(frozen=True, slots=True)
class Continuation:
    """Where a request continuing a stored response goes, and what it is keyed from."""

    holder: Worker
    chain: StoredChain | None  # None: not known here (dropped, or never written)


async def continuation_of(
    response_id: str,
    tenant: str | None,
    owners: ResponseOwners,
    fleet: Fleet,
    shared: OwnerLookup | None,
) -> Continuation:
    """The worker holding ``response_id`` for ``tenant``, and the response's conversation
    where it is known: here, or where another replica wrote it (read with the owner, so
    an owner learnt from Redis comes with its chain, if it has one);
    ``ResponseNotFound`` where no worker holds it, or the response is another tenant's."""
    owner = owners.get(response_id)
    chain = owners.chain(response_id) if owner is not None else None
    if owner is None and shared is not None:
        owner, chain = await shared.stored_response(response_id)
        if owner is not None:
            owners.remember(response_id, owner, chain)
    if owner is not None and not owner.reachable_by(tenant):
        owner = None
    worker = owner.holder(fleet) if owner is not None else None
    if worker is None:
        raise ResponseNotFound(response_id)
    return Continuation(worker, chain)


async def holder_of(
    response_id: str,
    tenant: str | None,
    owners: ResponseOwners,
    fleet: Fleet,
    shared: OwnerLookup | None,
) -> Worker:
    """``continuation_of``'s worker alone (a ``GET`` or ``cancel`` of the response)."""
    return (await continuation_of(response_id, tenant, owners, fleet, shared)).holder
