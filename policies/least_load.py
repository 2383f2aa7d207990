"""Least load: send each request to the worker with the least outstanding work.

The load measure lives here because power-of-two and the session policy's fallback use
the same one, so "load" means one thing in every policy's decisions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from policies.base import Decision, Policy, RouteRequest, WorkerView

# 0 counts requests only (outstanding tokens just break ties), like SGLang's shortest
# queue. A positive value makes that many outstanding prompt tokens weigh as much as one
# request, e.g. 4096 so a 32k-token turn counts as 8 short ones.
DEFAULT_TOKEN_WEIGHT = 0


@dataclass(frozen=True, slots=True)
class LeastLoadParams:
    token_weight: int = DEFAULT_TOKEN_WEIGHT

    def __post_init__(self) -> None:
        if self.token_weight < 0:
            raise ValueError(f"token_weight must be >= 0, got {self.token_weight}")


def load_key(view: WorkerView, token_weight: int) -> tuple[int, int]:
    """The worker's load, lower is less loaded: (weighted load, outstanding tokens).

    With ``token_weight`` w > 0 the weighted load is ``requests * w + tokens``, which
    orders workers exactly as ``requests + tokens / w`` without floating point.
    """
    if token_weight == 0:
        return (view.outstanding_requests, view.outstanding_tokens)
    weighted = view.outstanding_requests * token_weight + view.outstanding_tokens
    return (weighted, view.outstanding_tokens)


def least_loaded(candidates: Sequence[WorkerView], token_weight: int) -> WorkerView:
    """The least loaded candidate; equal loads go to the first name, so it is stable."""
    return min(candidates, key=lambda v: (*load_key(v, token_weight), v.name))


class LeastLoadPolicy(Policy):
    """Fewest outstanding requests; ties by outstanding tokens, then by name."""

    name: ClassVar[str] = "least_load"
    params_type: ClassVar[type[LeastLoadParams]] = LeastLoadParams

    def __init__(self, params: LeastLoadParams | None = None) -> None:
        self.params = params if params is not None else LeastLoadParams()

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> Decision:
        chosen = least_loaded(candidates, self.params.token_weight)
        return Decision(chosen.name, "load", chosen.matched_tokens)
