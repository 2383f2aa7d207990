"""Cache aware, as SGLang's router does it: prefix affinity unless the load is skewed.

Ported from sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs`` (and, for the
``low_match_target`` knob, ``sgl-model-gateway/src/policies/cache_aware.rs``):

1. Load is a worker's outstanding requests. It is imbalanced when
   ``max - min > balance_abs_threshold`` and ``max > min * balance_rel_threshold``;
   then the least loaded worker wins (reason "load").
2. Otherwise the worker holding the longest prefix of this prompt wins if
   ``matched / prompt > cache_threshold`` (reason "prefix").
3. Otherwise the prompt is effectively new: SGLang's sgl-router sends it to the worker
   with the smallest approximate tree, i.e. the most free cache (reason "load"). The
   later sgl-model-gateway sends it to the least loaded worker instead; the
   ``low_match_target`` knob picks either.

Differences from SGLang, on purpose:

- SGLang matches characters of the request text in a radix tree of what it routed; we
  match whole prefix blocks, which arrive as ``WorkerView.matched_tokens``, and divide by
  the estimated ``prompt_tokens``. "Tree size" is ``WorkerView.resident_tokens``.
- SGLang takes min/max load over every worker, healthy or not; we see only eligible
  candidates, so a dead worker's stale count cannot force load-balancing mode.
- Ties. Where SGLang uses ``min_by_key`` over the worker list (least load) the first
  worker in list order wins, and so does the first candidate here. Where SGLang reads the
  tree (the matched worker, the smallest tree) a tie goes to whichever tenant a DashMap
  happens to iterate first; here it goes to fewer outstanding requests, then candidate
  order, so a prefix every worker holds (a shared system prompt) spreads by load instead
  of by hash order.
- SGLang inserts the routed request into its tree inside the policy; here the router
  records dispatches in its prefix index, and the policy only decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from policies.base import Decision, Policy, RouteRequest, WorkerView

LowMatchTarget = Literal["smallest_cache", "least_load"]
LOW_MATCH_TARGETS: tuple[LowMatchTarget, ...] = ("smallest_cache", "least_load")

# SGLang has two sets of defaults: the Rust ``CacheAwareConfig::default()`` is
# 0.5 / 32 / 1.1, the Python launcher (``router_args.py``) 0.3 / 64 / 1.5. These are
# the launcher's, which is what ``python -m sglang_router.launch_router`` runs with.
# Route by prefix only when the best worker holds more than this share of the prompt.
DEFAULT_CACHE_THRESHOLD = 0.3
# Load-balancing mode needs the request-count spread to exceed this many requests...
DEFAULT_BALANCE_ABS_THRESHOLD = 64
# ...and the busiest worker to carry more than this many times the idlest one's load
# (1.0 leaves only the absolute spread, which already implies max > min).
DEFAULT_BALANCE_REL_THRESHOLD = 1.5
# Where a prompt with no useful match goes (sgl-router's behaviour).
DEFAULT_LOW_MATCH_TARGET: LowMatchTarget = "smallest_cache"


@dataclass(frozen=True, slots=True)
class CacheAwareParams:
    cache_threshold: float = DEFAULT_CACHE_THRESHOLD
    balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD
    balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD
    low_match_target: LowMatchTarget = DEFAULT_LOW_MATCH_TARGET

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(
                f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}"
            )
        if not self.balance_rel_threshold >= 1.0:
            raise ValueError(
                f"balance_rel_threshold must be >= 1.0, got {self.balance_rel_threshold}"
            )
        if self.low_match_target not in LOW_MATCH_TARGETS:
            raise ValueError(
                f"low_match_target must be one of {', '.join(LOW_MATCH_TARGETS)}, "
                f"got {self.low_match_target!r}"
            )


def _load(view: WorkerView) -> int:
    return view.outstanding_requests


class CacheAwarePolicy(Policy):
    """Longest cached prefix while loads are balanced; least load when they are not."""

    name: ClassVar[str] = "cache_aware"
    params_type: ClassVar[type[CacheAwareParams]] = CacheAwareParams

    def __init__(self, params: CacheAwareParams | None = None) -> None:
        self.params = params if params is not None else CacheAwareParams()

    def is_imbalanced(self, candidates: Sequence[WorkerView]) -> bool:
        loads = [v.outstanding_requests for v in candidates]
        high, low = max(loads), min(loads)
        return (
            high - low > self.params.balance_abs_threshold
            and high > low * self.params.balance_rel_threshold
        )

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> Decision:
        # min() returns the first of equal minima, as Rust's min_by_key does.
        if self.is_imbalanced(candidates):
            return self._load_decision(min(candidates, key=_load))
        best = min(candidates, key=lambda v: (-v.matched_tokens, v.outstanding_requests))
        rate = best.matched_tokens / request.prompt_tokens if request.prompt_tokens > 0 else 0.0
        if rate > self.params.cache_threshold:
            return Decision(best.name, "prefix", best.matched_tokens)
        if self.params.low_match_target == "least_load":
            return self._load_decision(min(candidates, key=_load))
        return self._load_decision(
            min(candidates, key=lambda v: (v.resident_tokens, v.outstanding_requests))
        )

    @staticmethod
    def _load_decision(chosen: WorkerView) -> Decision:
        # Both the least loaded and the emptiest cache are load-spreading choices.
        return Decision(chosen.name, "load", chosen.matched_tokens)
