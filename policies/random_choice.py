"""Random: a uniform choice among the candidates.

Named ``random_choice`` so the module does not shadow the standard ``random``; the
policy's registered name is "random". Seeded, so a benchmark run can be replayed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from policies.base import Decision, Policy, RouteRequest, WorkerView


@dataclass(frozen=True, slots=True)
class RandomParams:
    """Random has no knobs; its seed comes from the router's run seed."""


class RandomPolicy(Policy):
    """Each request goes to a candidate drawn uniformly from a seeded generator."""

    name: ClassVar[str] = "random"
    params_type: ClassVar[type[RandomParams]] = RandomParams

    def __init__(self, params: RandomParams | None = None, *, seed: int | None = None) -> None:
        self.params = params if params is not None else RandomParams()
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> Decision:
        chosen = self._rng.choice(candidates)
        return Decision(chosen.name, "random", chosen.matched_tokens)
