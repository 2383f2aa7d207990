"""Round robin: rotate over the candidates, ignoring load and cache.

The baseline every other policy has to beat. Candidates are ordered by name before
indexing so the rotation does not depend on the order the router lists them in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from policies.base import Decision, Policy, RouteRequest, WorkerView


@dataclass(frozen=True, slots=True)
class RoundRobinParams:
    """Round robin has no knobs."""


class RoundRobinPolicy(Policy):
    """The n-th request goes to the (n mod len(candidates))-th candidate by name."""

    name: ClassVar[str] = "round_robin"
    params_type: ClassVar[type[RoundRobinParams]] = RoundRobinParams

    def __init__(self, params: RoundRobinParams | None = None) -> None:
        self.params = params if params is not None else RoundRobinParams()
        self._counter = 0

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> Decision:
        # When the candidate set changes (a worker fails a health check) the rotation
        # shifts by at most one step; no per-worker state is worth keeping for that.
        ordered = sorted(candidates, key=lambda v: v.name)
        chosen = ordered[self._counter % len(ordered)]
        self._counter += 1
        return Decision(chosen.name, "rotation", chosen.matched_tokens)
