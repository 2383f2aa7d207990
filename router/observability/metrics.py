"""The router's Prometheus metrics, on a registry the app owns (one per app, no globals).

Counters end in ``_total``, durations are ``_seconds`` histograms; labels come from small
fixed sets (worker *name*, model, policy, reason, outcome), never a session or request id.
Per-worker gauges (load, resident tokens, health) are read from the fleet at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Literal, Protocol, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.index.residency import PREFIX_MODES, PrefixIndex
from router.observability.loop_metrics import EventLoopCollector, running_loop
from router.observability.metric_types import (
    CounterChild,
    HistogramChild,
    LoopCounter,
    LoopHistogram,
)
from router.observability.outcomes import CAUSES, TURN_OUTCOMES, WAITING
from router.wire.buckets import VLLM_TTFT_BUCKETS
from router.wire.kinds import Kind

# TTFT and latency buckets: vLLM's TTFT buckets.
TTFT_BUCKETS = VLLM_TTFT_BUCKETS
# How long a session is away between turns: an agent's tool call returns within seconds,
# a person within minutes, or never.
RETURN_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
ContinuationKeyed = Literal["chain", "cut", "blind"]
CONTINUATIONS_KEYED: tuple[ContinuationKeyed, ...] = get_args(ContinuationKeyed)
DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class _Breaker(Protocol):
    @property
    def reported_state(self) -> int: ...


class WorkerGauges(Protocol):
    """What the per-worker gauges read of a worker (``router.fleet.workers.Worker``)."""

    name: str
    outstanding_requests: int
    outstanding_tokens: int
    queued_prefill_tokens: int
    capacity_tokens: int
    healthy: bool
    engine_running: int
    engine_waiting: int
    engine_offload_hits: float

    @property
    def breaker(self) -> _Breaker: ...


class Workers(Protocol):
    """The fleet, as the metrics read it (``router.fleet.workers.Fleet``)."""

    @property
    def workers(self) -> Mapping[str, WorkerGauges]: ...

    def all(self) -> Sequence[WorkerGauges]: ...


class _FleetCollector(Collector):
    def __init__(self, fleet: Workers, index: PrefixIndex, block_tokens: int) -> None:
        self._fleet = fleet
        self._index = index
        self._block_tokens = block_tokens

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            "outstanding_requests": GaugeMetricFamily(
                "kvrouter_worker_outstanding_requests",
                "Requests this router dispatched to the worker that have not finished.",
                labels=["worker"],
            ),
            "outstanding_tokens": GaugeMetricFamily(
                "kvrouter_worker_outstanding_tokens",
                "Prompt tokens of the outstanding requests.",
                labels=["worker"],
            ),
            "queued_prefill": GaugeMetricFamily(
                "kvrouter_worker_queued_prefill_tokens",
                "Uncached prompt tokens dispatched whose first byte has not arrived.",
                labels=["worker"],
            ),
            "resident": GaugeMetricFamily(
                "kvrouter_worker_resident_tokens",
                "Tokens the residency model says the worker holds in its KV cache.",
                labels=["worker"],
            ),
            "capacity": GaugeMetricFamily(
                "kvrouter_worker_capacity_tokens",
                "The worker's KV-cache capacity in tokens.",
                labels=["worker"],
            ),
            "healthy": GaugeMetricFamily(
                "kvrouter_worker_healthy",
                "1 if the worker passes its health probes.",
                labels=["worker"],
            ),
            "engine_running": GaugeMetricFamily(
                "kvrouter_worker_engine_running_requests",
                "Requests the engine reports running (its /metrics).",
                labels=["worker"],
            ),
            "engine_waiting": GaugeMetricFamily(
                "kvrouter_worker_engine_waiting_requests",
                "Requests the engine reports waiting (its /metrics).",
                labels=["worker"],
            ),
            "circuit": GaugeMetricFamily(
                "kvrouter_worker_circuit_state",
                "The worker's circuit breaker: 0 closed, 1 half-open, 2 open.",
                labels=["worker"],
            ),
        }
        for w in self._fleet.all():
            resident = self._index.resident_blocks(w.name) * self._block_tokens
            for key, value in (
                ("outstanding_requests", w.outstanding_requests),
                ("outstanding_tokens", w.outstanding_tokens),
                ("queued_prefill", w.queued_prefill_tokens),
                ("resident", resident),
                ("capacity", w.capacity_tokens),
                ("healthy", 1 if w.healthy else 0),
                ("circuit", int(w.breaker.reported_state)),
                ("engine_running", w.engine_running),
                ("engine_waiting", w.engine_waiting),
            ):
                families[key].add_metric([w.name], value)
        yield from families.values()
        yield self._prefix_modes()
        yield GaugeMetricFamily(
            "kvrouter_index_blocks",
            "Prefix-index entries over all workers.",
            value=self._index.size(),
        )

    def _prefix_modes(self) -> GaugeMetricFamily:
        modes = GaugeMetricFamily(
            "kvrouter_prefix_mode",
            "1 for the mode of the worker's prefix residency: exact (what its engine's KV "
            "events announce) or approximate (a modelled LRU of the router's own hashes).",
            labels=["worker", "mode"],
        )
        for w in self._fleet.all():
            current = self._index.prefix_mode(w.name)
            for mode in PREFIX_MODES:
                modes.add_metric([w.name, mode], 1 if mode == current else 0)
        return modes


class RouterMetrics:
    def __init__(self, fleet: Workers, index: PrefixIndex, block_tokens: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = LoopCounter(
            "kvrouter_requests",
            "Requests by final outcome.",
            ["model", "worker", "outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "kvrouter_rejected_requests",
            "Requests answered by the router itself.",
            ["status"],
            registry=r,
        )
        self.decisions = LoopCounter(
            "kvrouter_routing_decisions",
            "Routing decisions by policy and reason.",
            ["policy", "reason"],
            registry=r,
        )
        self.retries = LoopCounter(
            "kvrouter_retries",
            "Dispatches retried on another worker before the first byte.",
            ["worker"],
            registry=r,
        )
        self.prompt_tokens = LoopCounter(
            "kvrouter_prompt_tokens",
            "Prompt tokens routed (engine-reported when known).",
            ["worker"],
            registry=r,
        )
        self.best_cached_tokens = LoopCounter(
            "kvrouter_best_cached_tokens",
            "Prompt tokens the best-placed worker in the fleet was modelled to hold.",
            ["worker"],
            registry=r,
        )
        self.predicted_cached_tokens = LoopCounter(
            "kvrouter_predicted_cached_tokens",
            "Prompt tokens the chosen worker was modelled to hold.",
            ["worker"],
            registry=r,
        )
        self.predicted_offloaded_tokens = LoopCounter(
            "kvrouter_predicted_offloaded_tokens",
            "Prompt tokens beyond its GPU match the chosen worker's CPU tier was known to "
            "hold (its engine reads them back rather than computing them).",
            ["worker"],
            registry=r,
        )
        self.engine_usage_rejected = LoopCounter(
            "kvrouter_engine_usage_rejected",
            "Replies whose usage held a field that is not a token count (negative, "
            "absurd, more cached than prompted): taken as unknown.",
            ["worker"],
            registry=r,
        )
        self.engine_cached_tokens = LoopCounter(
            "kvrouter_engine_cached_tokens",
            "Cached prompt tokens the engine reported (usage.prompt_tokens_details).",
            ["worker"],
            registry=r,
        )
        self.usage_prompt_tokens = LoopCounter(
            "kvrouter_usage_prompt_tokens",
            "Prompt tokens of responses that reported usage (the hit-rate denominator).",
            ["worker"],
            registry=r,
        )
        # Labelled by the configured sources (``session_keys``) and "none": a fixed set.
        self.session_keys = LoopCounter(
            "kvrouter_session_keys",
            "Requests by where their session key was read (none: the request named none).",
            ["source"],
            registry=r,
        )
        # By client API (chat, completion, responses, messages): a fixed set of labels.
        self.api_requests = LoopCounter(
            "kvrouter_api_requests",
            "Requests by client API and final outcome.",
            ["api", "outcome"],
            registry=r,
        )
        self.api_engine_cached_tokens = LoopCounter(
            "kvrouter_api_engine_cached_tokens",
            "Cached prompt tokens the engine reported, by client API (each API's usage).",
            ["api"],
            registry=r,
        )
        self.api_usage_prompt_tokens = LoopCounter(
            "kvrouter_api_usage_prompt_tokens",
            "Prompt tokens of responses that reported usage, by client API.",
            ["api"],
            registry=r,
        )
        self.continuations = LoopCounter(
            "kvrouter_continuations",
            "Responses requests continuing a stored response (previous_response_id), by "
            "how they were keyed: chain (as the stored conversation followed by their "
            "input), cut (by the first blocks of a conversation past the bound on one "
            "chain), blind (no blocks: the conversation's chain unknown here, of another "
            "context, or its input not rendered as the engine renders it).",
            ["keyed"],
            registry=r,
        )
        self.ttft = LoopHistogram(
            "kvrouter_time_to_first_token_seconds",
            "Time from dispatch to the first response byte from the worker.",
            ["worker"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.latency = LoopHistogram(
            "kvrouter_request_duration_seconds",
            "Time from arrival to the end of the response.",
            ["worker"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.decision_seconds = LoopHistogram(
            "kvrouter_routing_decision_seconds",
            "Time to hash the prompt, look up the index and choose a worker.",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.turns = LoopCounter(
            "kvrouter_turns",
            "Turns by what happened to their prefix (engine-reported).",
            ["outcome"],
            registry=r,
        )
        self.lost_turns = LoopCounter(
            "kvrouter_lost_prefix_turns",
            "Turns that lost part of their history, by cause.",
            ["cause"],
            registry=r,
        )
        self.lost_tokens = LoopCounter(
            "kvrouter_lost_prefix_tokens",
            "History tokens re-read because they were lost.",
            ["cause"],
            registry=r,
        )
        self.session_turn_ends = LoopCounter(
            "kvrouter_session_turn_ends",
            "Turns of sessions with a key, by what the reply left the session waiting on: "
            "a tool it called, a person, or nothing (finished: X-Session-End).",
            ["waiting_on"],
            registry=r,
        )
        self.session_return = LoopHistogram(
            "kvrouter_session_return_seconds",
            "Time from the end of a session's turn to its next request, by what that turn "
            "left it waiting on (tool, user, finished).",
            ["after"],
            buckets=RETURN_BUCKETS,
            registry=r,
        )
        self.turn_ttft = LoopHistogram(
            "kvrouter_turn_time_to_first_token_seconds",
            "TTFT of streamed turns by outcome (hit, partial, miss, first_turn).",
            ["outcome"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.worker_restarts = Counter(
            "kvrouter_worker_restarts",
            "Engine restarts seen (process_start_time_seconds changed); its entries purged.",
            ["worker"],
            registry=r,
        )
        self.prefill_rate = Gauge(
            "kvrouter_prefill_tokens_per_second",
            "Fleet prefill speed learned from TTFTs and engine-reported uncached tokens.",
            registry=r,
        )
        self.policy_info = Gauge(
            "kvrouter_policy_info",
            "1 for the routing policy in force and its knobs (every knob, defaults included).",
            ["policy", "knobs"],
            registry=r,
        )
        self.policy_changes = Counter(
            "kvrouter_policy_changes",
            "Routing policy changes applied (PUT /admin/policy here or on another replica).",
            registry=r,
        )
        self.residency_share = Gauge(
            "kvrouter_worker_residency_share",
            "Calibrated share of the worker's nominal KV capacity the model assumes held.",
            ["worker"],
            registry=r,
        )
        self.worker_reads_refused = Counter(
            "kvrouter_worker_reads_refused",
            "Reads of a worker's /v1/models or /metrics that gave nothing the router could "
            "use (no answer, not 200, past the size limit, not parseable), by what: models, "
            "metrics; and capacity: a KV capacity claimed past any engine's, capped.",
            ["worker", "what"],
            registry=r,
        )
        self._per_worker: tuple[Counter | Gauge | LoopCounter | LoopHistogram, ...] = (
            self.worker_reads_refused,
            self.engine_usage_rejected,
            self.requests,
            self.retries,
            self.prompt_tokens,
            self.best_cached_tokens,
            self.predicted_cached_tokens,
            self.predicted_offloaded_tokens,
            self.engine_cached_tokens,
            self.usage_prompt_tokens,
            self.ttft,
            self.latency,
            self.worker_restarts,
            self.residency_share,
        )
        self._series: dict[str, WorkerSeries] = {}
        self._counters: dict[tuple[str, tuple[str, ...]], CounterChild] = {}
        self._histograms: dict[tuple[str, tuple[str, ...]], HistogramChild] = {}
        self._fleet = fleet
        r.register(_FleetCollector(fleet, index, block_tokens))
        r.register(EventLoopCollector(running_loop()))
        # Series for every fixed label value from the start, so rates and dashboards
        # read 0 rather than "no data" before the first event.
        for api in get_args(Kind):
            self.api_engine_cached_tokens.labels(api)
            self.api_usage_prompt_tokens.labels(api)
            self.api_requests.labels(api, "success")
        for outcome in TURN_OUTCOMES:
            self.turns.labels(outcome)
        for waiting in WAITING:
            self.session_turn_ends.labels(waiting)
            self.session_return.labels(waiting)
        for keyed in CONTINUATIONS_KEYED:
            self.continuations.labels(keyed)
        for cause in CAUSES:
            self.lost_turns.labels(cause)
            self.lost_tokens.labels(cause)

    def worker_added(self, worker: str) -> None:
        self._series[worker] = WorkerSeries(self, worker)

    def worker(self, name: str) -> WorkerSeries:
        """The worker's series, their labels looked up once. For a worker no longer in
        the fleet (a request in flight when it was removed ends after it), series that
        count nowhere: made now, they would be scraped for as long as the router runs."""
        series = self._series.get(name)
        if series is None:
            if name not in self._fleet.workers:
                return WorkerSeries(self, name, detached=True)
            series = self._series[name] = WorkerSeries(self, name)
        return series

    def counter(self, metric: LoopCounter, *values: str) -> CounterChild:
        """``metric.labels(*values)``, looked up once: for label values from a small
        fixed set (policy and reason, outcome, cause), never a worker's name (those are
        in ``worker()``, dropped with the worker)."""
        child = self._counters.get((metric.name, values))
        if child is None:
            child = self._counters[(metric.name, values)] = metric.labels(*values)
        return child

    def histogram(self, metric: LoopHistogram, *values: str) -> HistogramChild:
        """As ``counter``, for a histogram."""
        child = self._histograms.get((metric.name, values))
        if child is None:
            child = self._histograms[(metric.name, values)] = metric.labels(*values)
        return child

    @property
    def fleet_workers(self) -> Mapping[str, object]:
        return self._fleet.workers

    def worker_removed(self, worker: str) -> None:
        """Drop the worker's series: a removed worker would otherwise be scraped forever
        (and with workers coming and going through discovery, the series would pile up)."""
        self._series.pop(worker, None)
        for metric in self._per_worker:
            metric.remove_by_labels({"worker": worker})

    def render(self) -> bytes:
        return generate_latest(self.registry)


class WorkerSeries:
    """One worker's per-request series, their label values bound when it joined."""

    __slots__ = (
        "_detached",
        "_metrics",
        "_name",
        "_requests",
        "best_cached_tokens",
        "engine_cached_tokens",
        "latency",
        "predicted_cached_tokens",
        "predicted_offloaded_tokens",
        "prompt_tokens",
        "residency_share",
        "retries",
        "ttft",
        "usage_prompt_tokens",
    )

    def __init__(self, metrics: RouterMetrics, name: str, detached: bool = False) -> None:
        self._metrics = metrics
        self._name = name
        self._detached = detached
        self._requests: dict[tuple[str, str], CounterChild] = {}
        self.retries = metrics.retries.labels(name)
        self.prompt_tokens = metrics.prompt_tokens.labels(name)
        self.best_cached_tokens = metrics.best_cached_tokens.labels(name)
        self.predicted_cached_tokens = metrics.predicted_cached_tokens.labels(name)
        self.predicted_offloaded_tokens = metrics.predicted_offloaded_tokens.labels(name)
        self.engine_cached_tokens = metrics.engine_cached_tokens.labels(name)
        self.usage_prompt_tokens = metrics.usage_prompt_tokens.labels(name)
        self.ttft = metrics.ttft.labels(name)
        self.latency = metrics.latency.labels(name)
        self.residency_share = metrics.residency_share.labels(name)
        self._detach()

    def requests(self, model: str, outcome: str) -> CounterChild:
        """``model`` is a bounded label value already (``Fleet.model_label``)."""
        key = (model, outcome)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self._metrics.requests.labels(model, self._name, outcome)
            self._detach()
        return child

    def _detach(self) -> None:
        """A detached series' children leave their metrics as soon as they are made
        (unless the worker has joined again since: then they are its own)."""
        if self._detached and self._name not in self._metrics.fleet_workers:
            self._metrics.worker_removed(self._name)
