"""TTFT: send each request where its estimated time to first token is lowest.

For each candidate worker ``w``::

    queue_s(w) = queued_prefill_tokens(w) / rate(w)          prefill work already waiting
    new(w)     = prompt_tokens - cache_weight x matched(w)    what this request prefills
    evict(w)   = max(0, resident(w) + new(w) - capacity(w))   cached tokens it pushes out
    back(w)    = of those, how many their sessions are expected to come back for
    ttft(w)    = queue_s(w) + (max(0, new(w)) + eviction_weight x evict(w)
                                + return_weight x back(w)) / rate(w)

``rate(w)`` is the worker's prefill speed, learned by the router from observed TTFTs;
``matched(w)`` is how much of this prompt the worker is modelled to hold, ``resident(w)``
how much it holds in all and ``capacity(w)`` its KV capacity.

A worker whose engine offloads to CPU memory may hold more of the prompt there, beyond
its GPU match (``offloaded(w)``): reading it back costs its bytes over the host link, not
its prefill, so it counts as cached and adds its reload to the estimate::

    new(w)     = prompt_tokens - cache_weight x (matched(w) + offloaded(w))
    ttft(w)    = ... + offloaded(w) / reload_rate(w)

``reload_rate(w)`` is tokens a second over the worker's host link (its KV bytes per token
and link speed, ``router.planning.reload``); where it is not known, or with
``count_offloaded`` off (the default), a CPU-tier hit is not credited. A CPU tier keeps
far more than the GPU, so every session stays in the tier of the worker that first
served it; taken at face value that credit would hold each session there for good,
however full that worker's GPU grows (measured: one worker of four took twice the
others' prompt tokens, and the hit rate fell). So while the best worker's GPU has no
room for what it would read back (``spread_reloads``, default on), the reload counts as
a tie with prefilling elsewhere, as a shared prefix does for a first turn: the near
worker with the least recent demand takes the turn, which is the holder only when it
is also the least busy.
Even so, on the agent sessions with CPU tiers four times the GPUs, the router blind to
the tiers hit more and had the shorter tail (a turn read back onto a busy worker's full
GPU waits for room there, which the estimate does not see; ``docs/benchmarks.md``):
``count_offloaded`` is off by default.

Two knobs trade affinity for load in plain terms: ``cache_weight`` is how much a cached
token is worth against a token of queued work (1.0 takes the estimate at face value; 0
ignores caches). ``eviction_weight`` is what a cached token of someone else's costs when
this request evicts it (on a full cache every token a request stores pushes one out,
and a session whose prefix was pushed out prefills it again on its next turn): above 0
it keeps sessions on full caches longer, trading TTFT for hit rate. Default 0: moving a
session off a full cache also frees its old copy, so on the agent workload the measured
trade was poor (``docs/benchmarks.md``, the sweep). ``return_weight`` prices only
the evicted tokens whose sessions are expected back (``WorkerView.returning_evicted_tokens``:
the oldest sessions on the worker's cache, each weighed by how likely a session idle
that long in its state, waiting on a tool, on a person or finished, is to return,
learned from the traffic): an agent seconds into a tool call costs its whole history,
a conversation that ended costs nothing, so a placement is steered to the worker whose
oldest cached sessions are the least likely to be missed. Default 0: charged in the
estimate, it moved turns off their caches to spare others' and lost more than it kept
on the agent workload (``docs/benchmarks.md``).

Prefixes that every worker holds (a shared system prompt) add the same saving to every
candidate and cancel out of the comparison: only the part of a prefix that distinguishes
workers attracts a request. A shared prefix that only some workers hold yet would pin
every new session to them: each first turn is cheapest where the prefix already is, and
is sent there, so no other worker ever gets it (on aiperf's agentic-code sessions, whose
prompts all begin with the same 8K tokens, every turn went to one worker of four, whose
cache could not hold them all). So a conversation's first turn
(``RouteRequest.first_turn``: no reply in it, so what any worker holds of it, other
sessions put there), while the worker holding the prefix has no room left for it (its
cache would give up other sessions' blocks to take this one), counts the prefill of the
prefix as part of the near-tie: a worker that would prefill it again, once, is as near
as the one that holds it, and the tie rules below place the new session. Its later turns
follow its own history as every turn does, and a first turn whose whole prompt a worker
already holds or is computing (best-of-N siblings, a retry) stays with it
(``spread_first_turns``, default on). Siblings that share a fresh prefix land together
because the router reserves a dispatched request's blocks on its worker at once
(recorded when the worker has computed them, withdrawn if the dispatch fails or is
refused): the second waits for the first's prefill on its worker or prefills alone
elsewhere, the same estimate give or take the few tokens the first did not fill a block
with.

While caches have room, where a request's tokens are stored decides more than a few
per cent of its TTFT: among workers whose estimate is within ``tie_tolerance`` (a share,
default 20%: about what the learned rate and the queue model can tell apart) of the best
and whose cache still has room for the request, the one left least full
(``resident + new``) wins, then fewer requests, then at random. That one rule sends a
sibling to the worker already computing its prompt (it stores no second copy) and
spreads new sessions over the emptier caches even while only some workers hold a shared
system prompt, which would otherwise draw every new session to them. Once no worker
near the best has room (after warm-up every cache is full of old sessions' blocks, and
resident tokens tie), the near-tie goes to the worker with the least recent demand: the
prompt tokens sent to it lately (``recent_prompt_tokens``, fading with a half-life of a
few turns, ``router.fleet.demand``) plus this request's new tokens, in seconds of that worker's
prefill. That is the live sessions' context, which will come back every turn; a slower
worker with as much of it counts as busier. With ``ties_spare_returns`` (default off) the
tokens this request would push out of the worker's cache that their sessions are
expected to come back for count as demand too (``WorkerView.returning_evicted_tokens``):
of two full caches, the one whose oldest sessions ended their conversations, or went
quiet long ago, takes the new work, and the one whose oldest sessions are agents in a tool
call keeps them. Off by default: on the agent and mix rows it moved the hit rate by
less than the rounds' own spread and TTFT p99 up a little (``docs/benchmarks.md``). Then
the estimate, fewer requests, at random.

``subagents_with_parent`` (default off) seats a subagent's first turn on its parent's
worker (``RouteRequest.parent_worker``) whenever that worker is among the near-best,
before the tie rules; spreading measured no worse (``docs/benchmarks.md``).

``temperature`` (seconds, default 0) samples instead of taking the minimum:
``P(w) ~ exp(-(ttft(w) - min ttft) / temperature)``, which spreads simultaneous arrivals
that would otherwise herd onto the same momentarily-best worker.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from policies.base import Decision, Policy, RouteRequest, WorkerView

DEFAULT_CACHE_WEIGHT = 1.0
DEFAULT_EVICTION_WEIGHT = 0.0
DEFAULT_RETURN_WEIGHT = 0.0
DEFAULT_TIE_TOLERANCE = 0.2
DEFAULT_TEMPERATURE_S = 0.0
# Rates below this are treated as this (tokens/s); guards a worker that has reported
# absurdly slow first tokens (e.g. after a stall) from dividing the estimate into infinity.
MIN_RATE = 1.0


@dataclass(frozen=True, slots=True)
class TtftParams:
    cache_weight: float = DEFAULT_CACHE_WEIGHT
    temperature: float = DEFAULT_TEMPERATURE_S
    eviction_weight: float = DEFAULT_EVICTION_WEIGHT
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE
    spread_first_turns: bool = True
    subagents_with_parent: bool = False
    return_weight: float = DEFAULT_RETURN_WEIGHT
    ties_spare_returns: bool = False
    # Off by default: measured, crediting CPU-tier hits lost hit rate and tail to the
    # same router blind to the tiers (docs/benchmarks.md, CPU tiers).
    count_offloaded: bool = False
    spread_reloads: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.tie_tolerance < 1:
            raise ValueError(f"tie_tolerance must be in [0, 1), got {self.tie_tolerance}")
        if self.cache_weight < 0:
            raise ValueError(f"cache_weight must be >= 0, got {self.cache_weight}")
        if self.eviction_weight < 0:
            raise ValueError(f"eviction_weight must be >= 0, got {self.eviction_weight}")
        if self.return_weight < 0:
            raise ValueError(f"return_weight must be >= 0, got {self.return_weight}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


def estimate_ttft(view: WorkerView, prompt_tokens: int, params: TtftParams) -> float:
    rate = max(view.prefill_tokens_per_s, MIN_RATE)
    reloaded = credited_offload(view, params)
    cached = view.matched_tokens + reloaded
    new = max(0.0, prompt_tokens - params.cache_weight * cached)
    evicted = max(0.0, view.resident_tokens + new - view.capacity_tokens)
    lost = params.eviction_weight * evicted + params.return_weight * view.returning_evicted_tokens
    reload_s = reloaded / view.reload_tokens_per_s if reloaded else 0.0
    return (view.queued_prefill_tokens + new + lost) / rate + reload_s


def credited_offload(view: WorkerView, params: TtftParams) -> int:
    """The CPU-tier tokens the estimate counts as cached (their reload priced)."""
    if params.count_offloaded and view.reload_tokens_per_s > 0:
        return view.offloaded_tokens
    return 0


class TtftPolicy(Policy):
    name: ClassVar[str] = "ttft"
    params_type: ClassVar[type[TtftParams]] = TtftParams

    def __init__(self, params: TtftParams | None = None, seed: int | None = None) -> None:
        self.params = params if params is not None else TtftParams()
        self._rng = random.Random(seed)

    @property
    def counts_returns(self) -> bool:
        return self.params.ties_spare_returns or self.params.return_weight > 0

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> Decision:
        params = self.params
        scored = []
        for v in candidates:
            estimate = estimate_ttft(v, request.prompt_tokens, params)
            new = max(0, request.prompt_tokens - v.matched_tokens)
            rate = max(v.prefill_tokens_per_s, MIN_RATE)
            demand = v.recent_prompt_tokens + new
            if params.ties_spare_returns:
                demand += v.returning_evicted_tokens
            scored.append(
                _Scored(
                    estimate=estimate,
                    filled=v.resident_tokens + new,
                    demand_s=demand / rate,
                    outstanding=v.outstanding_requests,
                    tiebreak=self._rng.random(),
                    view=v,
                )
            )
        if params.temperature > 0 and len(scored) > 1:
            chosen = self._sample(scored)
        else:
            spread = params.spread_first_turns and _opens_a_session(request, candidates)
            parent = request.parent_worker if params.subagents_with_parent else None
            chosen = self._best(scored, spread, parent if request.first_turn else None)
        best_match = max(v.matched_tokens + credited_offload(v, params) for v in candidates)
        held = chosen.matched_tokens + credited_offload(chosen, params)
        followed_cache = best_match > 0 and held == best_match
        return Decision(chosen.name, "prefix" if followed_cache else "load", held)

    def _best(
        self, scored: Sequence[_Scored], shared_prefix_ties: bool, parent: str | None = None
    ) -> WorkerView:
        best = min(scored, key=lambda s: s.estimate)
        near = best.estimate * (1 + self.params.tie_tolerance)
        full = best.filled > best.view.capacity_tokens
        rate = max(best.view.prefill_tokens_per_s, MIN_RATE)
        if shared_prefix_ties and full:
            near += self.params.cache_weight * best.view.matched_tokens / rate
        if self.params.spread_reloads and full:
            near += self.params.cache_weight * credited_offload(best.view, self.params) / rate
        close = [s for s in scored if s.estimate <= near]
        beside_parent = [s for s in close if s.view.name == parent]
        if beside_parent:
            return beside_parent[0].view
        roomy = [s for s in close if s.filled <= s.view.capacity_tokens]
        if roomy:
            return min(roomy, key=lambda s: (s.filled, s.outstanding, s.tiebreak)).view
        return min(close, key=lambda s: (s.demand_s, s.estimate, s.outstanding, s.tiebreak)).view

    def _sample(self, scored: Sequence[_Scored]) -> WorkerView:
        best = min(s.estimate for s in scored)
        weights = [math.exp(-(s.estimate - best) / self.params.temperature) for s in scored]
        return self._rng.choices([s.view for s in scored], weights=weights)[0]


def _opens_a_session(request: RouteRequest, candidates: Sequence[WorkerView]) -> bool:
    """A first turn that no worker holds whole: a new session over a shared prefix. One
    whose whole prompt a worker holds or is computing (all but a partial last block, of
    the router's blocks or the engine's) is a repeat of it (best-of-N, a retry), which
    belongs where the prompt is."""
    if not request.first_turn:
        return False
    for v in candidates:
        partial = max(request.block_tokens, v.cache_block_tokens)
        if v.matched_tokens > 0 and v.matched_tokens >= request.prompt_tokens - partial:
            return False
    return True


class _Scored(NamedTuple):
    estimate: float  # seconds to first token
    filled: int  # tokens the worker's cache would hold with this request's
    demand_s: float  # recent demand plus this request's new tokens, in prefill seconds
    outstanding: int
    tiebreak: float
    view: WorkerView
