"""The CPU tiers behind the workers' caches, read at scrape time: what each holds, how
fast it is read back, and whether the router can see it at all.

A worker's tier is in one of five states (``kvrouter_offload_tier``):

* ``announced`` — its engine announces the CPU tier's blocks with their tokens (vLLM's
  offloading connector with ``self_describing_kv_events``): the router knows what is
  there;
* ``by_hash`` — it announces them by hash alone (the connector's default): the router
  names them as the GPU named them, which fails for a block the GPU had already dropped
  (``kvrouter_offload_unnamed_blocks_total``);
* ``modelled`` — the worker is approximate and a tier is configured for it
  (``offload.tier_tokens``, ``workers[].offload_tokens``): the router models it as it
  models the GPU's cache;
* ``unannounced`` — the engine reports prompt tokens read from an offload tier (its
  /metrics) but announces none of it (a connector without CPU events, or a worker not in
  exact mode): the router cannot see the tier and credits nothing there, so turns it
  reloads look like hits it did not predict. A degraded state, shown rather than guessed;
* ``none`` — no sign of a tier.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, get_args

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.index.residency import LocalPrefixIndex
from router.observability.metrics import WorkerGauges, Workers

TierState = Literal["announced", "by_hash", "modelled", "unannounced", "none"]
TIER_STATES: tuple[TierState, ...] = get_args(TierState)


def tier_state(worker: WorkerGauges, index: LocalPrefixIndex) -> TierState:
    tier = index.offloaded_tier(worker.name)
    if tier is not None and tier.stores:
        return "announced" if tier.described else "by_hash"
    if tier is None and index.offloaded_modelled(worker.name):
        return "modelled"
    return "unannounced" if worker.engine_offload_hits > 0 else "none"


class OffloadCollector(Collector):
    def __init__(
        self,
        fleet: Workers,
        index: LocalPrefixIndex,
        block_tokens: int,
        reload_tokens_per_s: float,
    ) -> None:
        self._fleet = fleet
        self._index = index
        self._block_tokens = block_tokens
        self._reload_tokens_per_s = reload_tokens_per_s

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        held = GaugeMetricFamily(
            "kvrouter_worker_offloaded_tokens",
            "Tokens the worker's engine holds in its CPU tier, as announced (exact mode) "
            "or modelled (approximate, with a tier configured).",
            labels=["worker"],
        )
        states = GaugeMetricFamily(
            "kvrouter_offload_tier",
            "1 for the state of the worker's CPU tier: announced (its blocks with their "
            "tokens), by_hash (by hash alone), modelled (approximate, a tier configured), "
            "unannounced (the engine reads from a tier the router neither hears of nor "
            "models: it credits nothing there), none.",
            labels=["worker", "state"],
        )
        unnamed = CounterMetricFamily(
            "kvrouter_offload_unnamed_blocks",
            "CPU-tier blocks announced by hash alone that the router could not name "
            "(the GPU had dropped them first): not counted as held.",
            labels=["worker"],
        )
        engine_hits = CounterMetricFamily(
            "kvrouter_worker_engine_offload_hit_tokens",
            "Prompt tokens the engine reports reading from an offload tier (its /metrics).",
            labels=["worker"],
        )
        for w in self._fleet.all():
            tier = self._index.offloaded_tier(w.name)
            held.add_metric([w.name], self._index.offloaded_blocks(w.name) * self._block_tokens)
            unnamed.add_metric([w.name], tier.unnamed if tier else 0)
            engine_hits.add_metric([w.name], w.engine_offload_hits)
            state = tier_state(w, self._index)
            for s in TIER_STATES:
                states.add_metric([w.name, s], 1 if s == state else 0)
        yield held
        yield states
        yield unnamed
        yield engine_hits
        yield GaugeMetricFamily(
            "kvrouter_offload_reload_tokens_per_second",
            "How fast a worker is taken to read its CPU tier back (host link over KV bytes "
            "per token, router.planning.reload; 0: not known, a CPU-tier hit is not "
            "credited).",
            value=self._reload_tokens_per_s,
        )
