"""Power of two choices: sample two distinct candidates, send to the less loaded.

Nearly as well balanced as least load, but a router replica whose load counts lag
reality does not herd every request onto the one worker it believes is idlest
(Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing").
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from policies.base import Decision, Policy, RouteRequest, WorkerView
from policies.least_load import DEFAULT_TOKEN_WEIGHT, load_key


@dataclass(frozen=True, slots=True)
class PowerOfTwoParams:
    # Same load measure as least_load (see policies.least_load.DEFAULT_TOKEN_WEIGHT).
    token_weight: int = DEFAULT_TOKEN_WEIGHT

    def __post_init__(self) -> None:
        if self.token_weight < 0:
            raise ValueError(f"token_weight must be >= 0, got {self.token_weight}")


class PowerOfTwoPolicy(Policy):
    """The less loaded of two candidates drawn without replacement."""

    name: ClassVar[str] = "power_of_two"
    params_type: ClassVar[type[PowerOfTwoParams]] = PowerOfTwoParams

    def __init__(self, params: PowerOfTwoParams | None = None, *, seed: int | None = None) -> None:
        self.params = params if params is not None else PowerOfTwoParams()
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> Decision:
        if len(candidates) == 1:
            only = candidates[0]
            return Decision(only.name, "only_choice", only.matched_tokens)
        first, second = self._rng.sample(candidates, 2)
        weight = self.params.token_weight
        # Equal loads keep the first draw, as SGLang does: the draw is already random,
        # and breaking ties by name would tilt toward low names.
        chosen = second if load_key(second, weight) < load_key(first, weight) else first
        return Decision(chosen.name, "load", chosen.matched_tokens)
