"""Session affinity: consistent hashing with bounded loads.

Each turn of a session should land where the earlier turns left their KV cache, without
any table of sessions to keep or share between router replicas. Rendezvous
(highest-random-weight) hashing ranks the workers for a session key; when a worker is
added or removed only the sessions ranked first on it move (about 1/n of them). The load
bound (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads") skips a
worker that already carries more than ``load_factor`` times its fair share, so a few hot
sessions cannot pile onto one worker; the skipped session goes to its next-ranked worker,
which is again the same one for every turn while the overload lasts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import xxhash

from policies.base import Decision, Policy, RouteRequest, WorkerView
from policies.least_load import DEFAULT_TOKEN_WEIGHT, least_loaded

# A worker takes a session while its outstanding requests are below
# ceil(load_factor * (total outstanding + 1) / n). 1.25 is the paper's usual example
# (c = 1 + epsilon): lower moves sessions off their cache sooner, higher tolerates more
# skew. At >= 1 some worker is always under the bound.
DEFAULT_LOAD_FACTOR = 1.25


@dataclass(frozen=True, slots=True)
class SessionParams:
    load_factor: float = DEFAULT_LOAD_FACTOR

    def __post_init__(self) -> None:
        if not self.load_factor >= 1.0:
            raise ValueError(f"load_factor must be >= 1.0, got {self.load_factor}")


def rendezvous_order(session_key: str, candidates: Sequence[WorkerView]) -> list[WorkerView]:
    """Candidates from the session's most to least preferred worker.

    A worker's weight depends only on (session key, worker name), so removing a worker
    leaves the relative order of the others unchanged.
    """
    key_hash = xxhash.xxh3_64_intdigest(session_key.encode())

    def weight(view: WorkerView) -> tuple[int, str]:
        # Seeding with the key's hash keys the worker's hash without building a
        # concatenated string per worker.
        return (xxhash.xxh3_64_intdigest(view.name.encode(), seed=key_hash), view.name)

    return sorted(candidates, key=weight, reverse=True)


class SessionPolicy(Policy):
    """The session's highest-ranked worker under the load bound; no key: least load."""

    name: ClassVar[str] = "session"
    params_type: ClassVar[type[SessionParams]] = SessionParams

    def __init__(self, params: SessionParams | None = None) -> None:
        self.params = params if params is not None else SessionParams()

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> Decision:
        if request.session_key is None:
            idle = least_loaded(candidates, DEFAULT_TOKEN_WEIGHT)
            return Decision(idle.name, "load", idle.matched_tokens)
        total = sum(v.outstanding_requests for v in candidates)
        bound = math.ceil(self.params.load_factor * (total + 1) / len(candidates))
        ranked = rendezvous_order(request.session_key, candidates)
        for rank, view in enumerate(ranked):
            if view.outstanding_requests < bound:
                # Reason "load" when the bound moved the session off its first choice,
                # so the diversion rate shows in the decision metrics.
                return Decision(view.name, "session" if rank == 0 else "load", view.matched_tokens)
        # Unreachable with load_factor >= 1 (the loads cannot all reach the bound);
        # kept so a future knob change cannot make choose() fail.
        idle = least_loaded(candidates, DEFAULT_TOKEN_WEIGHT)
        return Decision(idle.name, "load", idle.matched_tokens)
