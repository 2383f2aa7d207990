"""Prometheus metrics of one simulated engine, named and shaped as vLLM's or SGLang's.

Names, types, label names, bucket bounds and help texts are taken from the engines' own
sources (vLLM V1 ``vllm/v1/metrics/loggers.py``, SGLang ``python/sglang/srt/metrics/
collector.py``); where the simulation departs from them, the metric's own comment says so.

Each :class:`EngineMetrics` owns a private ``CollectorRegistry``, so any number of engines can
share a process, and a simulated restart (:meth:`EngineMetrics.reset`) rebuilds the registry.

Timing of the token counters: prompt and generation tokens are counted when a request
finishes (``record_finished``), in both flavors. SGLang does the same; vLLM counts prompt
tokens at the first token and generation tokens as they are produced, so a vLLM-flavored
counter lags the real one while a request is in flight, and converges when it finishes.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from bench.sim.metric_buckets import (
    SGLANG_E2E_BUCKETS,
    SGLANG_ITL_BUCKETS,
    SGLANG_QUEUE_TIME_BUCKETS,
    SGLANG_TTFT_BUCKETS,
    VLLM_REQUEST_LATENCY_BUCKETS,
    VLLM_TPOT_BUCKETS,
    build_1_2_5_buckets,
)
from router.wire.buckets import VLLM_TTFT_BUCKETS

Flavor = Literal["vllm", "sglang"]

# vLLM sizes its token-count histograms by max_model_len (1-2-5 buckets up to it); the
# interface carries no model config, so the engine passes it, or this default applies.
DEFAULT_MAX_MODEL_LEN = 8192

# vllm/v1/engine/__init__.py FINISH_REASON_STRINGS; vLLM pre-creates one series per reason.
VLLM_FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")

# SGLang's scheduler labels hold the parallel ranks; a simulated engine is one rank.
SGLANG_ENGINE_TYPE = "unified"
SGLANG_RANK = "0"
# An optional cache_config key: with it, the sglang flavor also exports
# sglang:max_total_num_tokens (the KV pool size in tokens), as SGLang does.
SGLANG_MAX_TOTAL_TOKENS_KEY = "max_total_num_tokens"


def observe_many(histogram: Histogram, values: Sequence[float]) -> None:
    """``histogram.observe`` of every value, one lock per bucket instead of per value
    (a request's inter-token gaps are thousands of values). Reaches into
    prometheus_client's Histogram (``_upper_bounds``, ``_buckets``, ``_sum``), which has
    no bulk call; ``tests/test_sim_metrics.py`` checks it against ``observe``.

    A value lands in the first bucket whose bound it does not exceed, so a bucket's
    count is how many sorted values lie in ``(previous bound, bound]``: one sort and a
    binary search per bound instead of one per value."""
    if not values:
        return
    ordered = sorted(values)
    counted, total = 0, len(ordered)
    for index, bound in enumerate(histogram._upper_bounds):
        upto = bisect.bisect_right(ordered, bound, counted)
        if upto > counted:
            histogram._buckets[index].inc(upto - counted)
            counted = upto
            if counted == total:
                break
    histogram._sum.inc(sum(values))


def observe(histogram: Histogram, value: float) -> None:
    """``histogram.observe(value)`` with a binary search for the bucket instead of
    prometheus_client's scan over every bound (a finished request makes ten of these);
    ``tests/test_sim_metrics.py`` checks it against ``observe``."""
    histogram._buckets[bisect.bisect_left(histogram._upper_bounds, value)].inc(1)
    histogram._sum.inc(value)


class _FlavorMetrics(Protocol):
    """The metrics of one flavor, already registered in a private registry."""

    def record_step(self, running: int, waiting: int, kv_usage: float) -> None: ...

    def record_prefix_query(self, queries: int, hits: int) -> None: ...

    def record_preemption(self) -> None: ...

    def record_first_token(self, ttft_s: float) -> None: ...

    def record_finished(self, request: _Finished) -> None: ...


@dataclass(frozen=True, slots=True)
class _Finished:
    """One finished request, as ``EngineMetrics.record_finished`` received it."""

    reason: str
    prompt_tokens: int
    generation_tokens: int
    e2e_s: float
    queue_s: float
    prefill_s: float
    decode_s: float
    inter_token_s: Sequence[float]


class _VllmMetrics:
    """vLLM V1's PrometheusStatLogger series for one engine index."""

    def __init__(
        self,
        registry: CollectorRegistry,
        histograms: CollectorRegistry,
        model_name: str,
        engine_id: str,
        cache_config: Mapping[str, str],
        max_model_len: int,
    ) -> None:
        names = ["model_name", "engine"]
        values = [model_name, engine_id]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(*values)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=histograms).labels(*values)

        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=registry,
        )
        self.success = {reason: success.labels(*values, reason) for reason in VLLM_FINISH_REASONS}
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.req_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.req_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            VLLM_TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            VLLM_TPOT_BUCKETS,
        )
        self.req_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            VLLM_TPOT_BUCKETS,
        )
        latency = VLLM_REQUEST_LATENCY_BUCKETS
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            latency,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            latency,
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            latency,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            latency,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            latency,
        )
        # An info-style gauge: the cache config fields plus "engine" as labels, value 1, and
        # no model_name label (vLLM's log_metrics_info).
        info = {**cache_config, "engine": engine_id}
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(info),
            registry=registry,
        ).labels(**info).set(1)

    def record_step(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    def record_prefix_query(self, queries: int, hits: int) -> None:
        self.prefix_queries.inc(queries)
        self.prefix_hits.inc(hits)

    def record_preemption(self) -> None:
        self.preemptions.inc()

    def record_first_token(self, ttft_s: float) -> None:
        observe(self.ttft, ttft_s)

    def record_finished(self, request: _Finished) -> None:
        if request.reason not in self.success:
            raise ValueError(
                f"unknown finished_reason {request.reason!r}; "
                f"known: {', '.join(VLLM_FINISH_REASONS)}"
            )
        self.success[request.reason].inc()
        self.prompt_tokens.inc(request.prompt_tokens)
        self.generation_tokens.inc(request.generation_tokens)
        observe(self.req_prompt_tokens, request.prompt_tokens)
        observe(self.req_generation_tokens, request.generation_tokens)
        observe_many(self.itl, request.inter_token_s)
        # vLLM leaves out the first token, which the prefill produced.
        decoded = request.generation_tokens - 1
        observe(self.req_tpot, request.decode_s / decoded if decoded > 0 else 0.0)
        observe(self.e2e, request.e2e_s)
        observe(self.queue, request.queue_s)
        observe(self.inference, request.prefill_s + request.decode_s)
        observe(self.prefill, request.prefill_s)
        observe(self.decode, request.decode_s)


class _SglangMetrics:
    """SGLang's scheduler and tokenizer-manager series for one single-rank server."""

    def __init__(
        self,
        registry: CollectorRegistry,
        histograms: CollectorRegistry,
        model_name: str,
        cache_config: Mapping[str, str],
    ) -> None:
        # SchedulerMetricsCollector labels / TokenizerMetricsCollector labels.
        sched = {
            "model_name": model_name,
            "engine_type": SGLANG_ENGINE_TYPE,
            "tp_rank": SGLANG_RANK,
            "pp_rank": SGLANG_RANK,
            "moe_ep_rank": SGLANG_RANK,
        }
        tok = {"model_name": model_name, "engine_type": SGLANG_ENGINE_TYPE}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(sched), registry=registry).labels(**sched)

        def counter(name: str, doc: str, labels: dict[str, str]) -> Counter:
            return Counter(name, doc, list(labels), registry=registry).labels(**labels)

        def histogram(
            name: str, doc: str, buckets: Sequence[float], labels: dict[str, str]
        ) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=histograms).labels(
                **labels
            )

        self.running = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.queued = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        max_tokens = cache_config.get(SGLANG_MAX_TOTAL_TOKENS_KEY)
        if max_tokens is not None:
            gauge(
                "sglang:max_total_num_tokens",
                "Maximum total number of tokens in the KV cache pool.",
            ).set(float(max_tokens))
        self.retracted = counter(
            "sglang:num_retracted_requests_total", "Total number of retracted requests.", sched
        )
        self.queue_time = histogram(
            "sglang:queue_time_seconds",
            "Histogram of queueing time in seconds.",
            SGLANG_QUEUE_TIME_BUCKETS,
            sched,
        )
        self.prompt_tokens = counter(
            "sglang:prompt_tokens_total", "Number of prefill tokens processed.", tok
        )
        self.generation_tokens = counter(
            "sglang:generation_tokens_total", "Number of generation tokens processed.", tok
        )
        self.cached_tokens = counter(
            "sglang:cached_tokens_total", "Number of cached prompt tokens.", tok
        )
        self.requests = counter("sglang:num_requests_total", "Number of requests processed.", tok)
        self.aborted = counter(
            "sglang:num_aborted_requests_total", "Number of requests aborted.", tok
        )
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            SGLANG_TTFT_BUCKETS,
            tok,
        )
        self.itl = histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            SGLANG_ITL_BUCKETS,
            tok,
        )
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            SGLANG_E2E_BUCKETS,
            tok,
        )
        # Tokens queried / hit by the requests scheduled since the last step: SGLang reports
        # the hit rate of its last prefill batch, not a cumulative one.
        self._batch_queries = 0
        self._batch_hits = 0

    def record_step(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.queued.set(waiting)
        self.token_usage.set(kv_usage)
        # A step that admitted nothing keeps the previous batch's rate (SGLang's periodic
        # decode log line writes 0.0 here instead; holding it is more useful to a reader).
        if self._batch_queries > 0:
            self.cache_hit_rate.set(self._batch_hits / self._batch_queries)
        self._batch_queries = 0
        self._batch_hits = 0

    def record_prefix_query(self, queries: int, hits: int) -> None:
        self._batch_queries += queries
        self._batch_hits += hits
        self.cached_tokens.inc(hits)

    def record_preemption(self) -> None:
        self.retracted.inc()

    def record_first_token(self, ttft_s: float) -> None:
        observe(self.ttft, ttft_s)

    def record_finished(self, request: _Finished) -> None:
        if request.reason == "abort":
            self.aborted.inc()
        self.requests.inc()
        self.prompt_tokens.inc(request.prompt_tokens)
        self.generation_tokens.inc(request.generation_tokens)
        observe_many(self.itl, request.inter_token_s)
        observe(self.e2e, request.e2e_s)
        observe(self.queue_time, request.queue_s)


class EngineMetrics:
    """The /metrics of one simulated engine, in vLLM's or SGLang's names.

    ``cache_config`` values are label values, formatted as vLLM formats them (``str()`` of
    the Python value: ``"True"``, ``"None"``, ``"0.9"``). The vllm flavor exports every key
    as a label of ``vllm:cache_config_info``; the sglang flavor reads only
    ``max_total_num_tokens``. ``engine_id`` is vLLM's ``engine`` label (the engine index,
    ``"0"`` on a single-engine server); SGLang has no such label.
    """

    def __init__(
        self,
        flavor: Flavor,
        model_name: str,
        engine_id: str,
        cache_config: Mapping[str, str],
        start_time: float,
        *,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    ) -> None:
        if flavor not in ("vllm", "sglang"):
            raise ValueError(f"unknown flavor {flavor!r}; known: vllm, sglang")
        if max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        self._flavor: Flavor = flavor
        self._model_name = model_name
        self._engine_id = engine_id
        self._cache_config = dict(cache_config)
        self._max_model_len = max_model_len
        self._build(start_time)

    def _build(self, start_time: float) -> None:
        # Histograms change only when a request starts streaming or finishes, yet are
        # most of the text: they live in a registry of their own whose rendering is
        # kept until one of them changes (an engine is scraped every second).
        registry, histograms = CollectorRegistry(), CollectorRegistry()
        metrics: _FlavorMetrics
        if self._flavor == "vllm":
            metrics = _VllmMetrics(
                registry,
                histograms,
                self._model_name,
                self._engine_id,
                self._cache_config,
                self._max_model_len,
            )
        else:
            metrics = _SglangMetrics(registry, histograms, self._model_name, self._cache_config)
        # prometheus_client's ProcessCollector would give every engine in this process the
        # same value, and a simulated restart could not move it.
        Gauge(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            registry=registry,
        ).set(start_time)
        self._registry, self._histograms, self._metrics = registry, histograms, metrics
        self._histogram_text: bytes | None = None

    @property
    def flavor(self) -> Flavor:
        return self._flavor

    def record_step(self, running: int, waiting: int, kv_usage: float) -> None:
        """After every scheduler step: the request counts and the KV usage fraction (0..1)."""
        self._metrics.record_step(running, waiting, kv_usage)

    def record_prefix_query(self, queries: int, hits: int) -> None:
        """Once per request, when first scheduled: prompt tokens looked up and found cached."""
        if not 0 <= hits <= queries:
            raise ValueError(f"need 0 <= hits <= queries, got hits={hits} queries={queries}")
        self._metrics.record_prefix_query(queries, hits)

    def record_preemption(self) -> None:
        self._metrics.record_preemption()

    def record_first_token(self, ttft_s: float) -> None:
        self._metrics.record_first_token(ttft_s)
        self._histogram_text = None

    def record_finished(
        self,
        finished_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        e2e_s: float,
        queue_s: float,
        prefill_s: float,
        decode_s: float,
        inter_token_s: Sequence[float],
    ) -> None:
        """Once per request as it leaves the engine; ``finished_reason`` is stop|length|abort."""
        self._metrics.record_finished(
            _Finished(
                finished_reason,
                prompt_tokens,
                generation_tokens,
                e2e_s,
                queue_s,
                prefill_s,
                decode_s,
                inter_token_s,
            )
        )
        self._histogram_text = None

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        if self._histogram_text is None:
            self._histogram_text = generate_latest(self._histograms)
        return generate_latest(self._registry) + self._histogram_text, CONTENT_TYPE_LATEST

    def reset(self, start_time: float) -> None:
        """A simulated restart: every series starts again from zero, with a new start time."""
        self._build(start_time)
