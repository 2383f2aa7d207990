"""TTFT: send each request where its estimated time to first token is lowest.

For each candidate worker ``w``::

    queue_s(w) = queued_prefill_tokens(w) / rate(w)          prefill work already waiting
    own_s(w)   = (prompt_tokens - cache_weight x matched(w)) / rate(w)
    ttft(w)    = queue_s(w) + max(0, own_s(w))

``rate(w)`` is the worker's prefill speed, learned by the router from observed TTFTs;
``matched(w)`` is how much of this prompt the worker is modelled to hold.

One knob trades affinity for load in plain terms: ``cache_weight`` is how much a cached
token is worth against a token of queued work. 1.0 takes the estimate at face value; 2.0
waits up to twice as long in a queue to reuse a cache; 0 ignores caches (pure load).

Prefixes that every worker holds (a shared system prompt) add the same saving to every
candidate and cancel out of the comparison, so they never pin traffic to one worker:
only the part of a prefix that distinguishes workers attracts a request. Siblings that
share a fresh prefix land together because the router records a dispatched request's
blocks on its worker at once (speculatively, withdrawn if the dispatch fails).

``temperature`` (seconds, default 0) samples instead of taking the minimum:
``P(w) ~ exp(-(ttft(w) - min ttft) / temperature)``, which spreads simultaneous arrivals
that would otherwise herd onto the same momentarily-best worker.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from policies.base import Decision, Policy, RouteRequest, WorkerView, params_from

DEFAULT_CACHE_WEIGHT = 1.0
DEFAULT_TEMPERATURE_S = 0.0
# Rates below this are treated as this (tokens/s); guards a worker that has reported
# absurdly slow first tokens (e.g. after a stall) from dividing the estimate into infinity.
MIN_RATE = 1.0


@dataclass(frozen=True, slots=True)
class TtftParams:
    cache_weight: float = DEFAULT_CACHE_WEIGHT
    temperature: float = DEFAULT_TEMPERATURE_S

    def __post_init__(self) -> None:
        if self.cache_weight < 0:
            raise ValueError(f"cache_weight must be >= 0, got {self.cache_weight}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


def estimate_ttft(view: WorkerView, prompt_tokens: int, cache_weight: float) -> float:
    rate = max(view.prefill_tokens_per_s, MIN_RATE)
    own = max(0.0, prompt_tokens - cache_weight * view.matched_tokens)
    return (view.queued_prefill_tokens + own) / rate


class TtftPolicy(Policy):
    name: ClassVar[str] = "ttft"
    params_type: ClassVar[type[TtftParams]] = TtftParams

    def __init__(self, params: TtftParams | None = None, seed: int | None = None) -> None:
        self.params = params if params is not None else TtftParams()
        self._rng = random.Random(seed)

    @classmethod
    def from_knobs(cls, knobs: Mapping[str, Any], seed: int | None = None) -> Self:
        return cls(params_from(TtftParams, knobs, cls.name), seed)

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> Decision:
        weight = self.params.cache_weight
        # Ties (idle fleet, nothing cached) go to the least-loaded, then at random, so
        # equal workers share new sessions instead of all going to the first name.
        scored = [
            (estimate_ttft(v, request.prompt_tokens, weight), v.outstanding_requests,
             self._rng.random(), v)
            for v in candidates
        ]
        if self.params.temperature > 0 and len(scored) > 1:
            chosen = self._sample(scored)
        else:
            chosen = min(scored, key=lambda s: s[:3])[3]
        best_match = max(v.matched_tokens for v in candidates)
        followed_cache = best_match > 0 and chosen.matched_tokens == best_match
        return Decision(chosen.name, "prefix" if followed_cache else "load",
                        chosen.matched_tokens)

    def _sample(self, scored: Sequence[tuple[float, int, float, WorkerView]]) -> WorkerView:
        best = min(s[0] for s in scored)
        weights = [math.exp(-(s[0] - best) / self.params.temperature) for s in scored]
        return self._rng.choices([s[3] for s in scored], weights=weights)[0]
