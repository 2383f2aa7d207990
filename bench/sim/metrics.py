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
The vLLM prompt-token splits (``prompt_tokens_by_source``, ``prompt_tokens_cached``) are
counted with ``prompt_tokens``, so they add up at any moment; ``iteration_tokens_total``
is observed per step (``record_iteration``), as vLLM does.
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
    VLLM_ITERATION_TOKENS_BUCKETS,
    VLLM_REQUEST_LATENCY_BUCKETS,
    VLLM_REQUEST_NUM_PREEMPTIONS_BUCKETS,
    VLLM_REQUEST_PARAMS_N_BUCKETS,
    VLLM_TPOT_BUCKETS,
    build_1_2_5_buckets,
)
from router.wire.buckets import VLLM_TTFT_BUCKETS

Flavor = Literal["vllm", "sglang"]

# vLLM sizes its token-count histograms by max_model_len (1-2-5 buckets up to it); the
# interface carries no model config, so the engine passes it, or this default applies.
DEFAULT_MAX_MODEL_LEN = 8192

VLLM_LABELS = ("model_name", "engine")
# vLLM pre-creates one series per value of these labels (vLLM 0.32): finish reasons
# (vllm/v1/engine/__init__.py FINISH_REASON_STRINGS), waiting reasons, sleep states,
# PromptTokenStats.ALL_SOURCES, CacheHitSource and the frontend's ADMISSION_REASONS.
VLLM_FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error", "repetition")
VLLM_WAITING_REASONS: tuple[str, ...] = ("capacity", "deferred")
VLLM_SLEEP_STATES: tuple[str, ...] = ("awake", "weights_offloaded", "discard_all")
VLLM_PROMPT_TOKEN_SOURCES: tuple[str, ...] = (
    "local_compute",
    "local_cache_hit",
    "external_kv_transfer",
)
VLLM_CACHE_HIT_SOURCES: tuple[str, ...] = ("device", "host", "p2p", "disk", "external_unspecified")
VLLM_ADMISSION_REASONS: tuple[str, ...] = ("max_num_queued_reqs", "max_num_queued_tokens")

# CacheConfig.DEFAULT_BLOCK_SIZE.
VLLM_DEFAULT_BLOCK_SIZE = 16
# Every field of vLLM 0.32's CacheConfig, in its order, as ``str()`` of the value a
# full-attention model with prefix caching has once the engine is up (``metrics_info``
# writes them all). ``block_size`` and ``num_gpu_blocks`` are placeholders the engine's
# cache_config replaces; the four capacity fields follow from those two
# (``_implied_by_kv_size``).
VLLM_CACHE_CONFIG_DEFAULTS: dict[str, str] = {
    "block_size": str(VLLM_DEFAULT_BLOCK_SIZE),
    "user_specified_block_size": "False",
    "kv_cache_layout": "None",
    "prefix_match_unit": "None",
    "gpu_memory_utilization": "0.92",
    "cache_dtype": "auto",
    "is_attention_free": "False",
    "num_gpu_blocks_override": "None",
    "sliding_window": "None",
    "enable_prefix_caching": "True",
    "prefix_caching_hash_algo": "sha256",
    "prefix_cache_retention_interval": "0",
    "kv_cache_dtype_skip_layers": "[]",
    "mamba_page_size_padded": "None",
    "skip_page_size_padded": "None",
    "mamba_block_size": "None",
    "mamba_cache_dtype": "auto",
    "mamba_ssm_cache_dtype": "auto",
    "mamba_cache_mode": "none",
    "enable_mamba_shared_prefix_checkpoint": "False",
    "replayssm_buffer_len": "16",
    "use_replayssm": "False",
    "use_kda_recoverssm": "False",
    "num_gpu_blocks": "None",
    "num_cpu_blocks": "None",
    "effective_attention_block_size": "None",
    "kv_cache_size_tokens": "None",
    "kv_cache_max_concurrency": "None",
    "hash_block_size": "None",
    "cache_hit_alignment_tokens": "None",
    "kv_sharing_fast_prefill": "False",
    "swa_bounded_replay": "True",
    "kv_cache_memory_bytes": "None",
    "kv_offloading_size": "None",
    "kv_offloading_backend": "native",
    "_block_size_resolved": "True",
}

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
    no bulk call; ``tests/sim/test_sim_metrics.py`` checks it against ``observe``.

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


def observe(histogram: Histogram, value: float, times: int = 1) -> None:
    """``histogram.observe(value)``, ``times`` times, with a binary search for the bucket
    instead of prometheus_client's scan over every bound (a finished request makes a dozen
    of these); ``tests/sim/test_sim_metrics.py`` checks it against ``observe``."""
    histogram._buckets[bisect.bisect_left(histogram._upper_bounds, value)].inc(times)
    histogram._sum.inc(value * times)


class _FlavorMetrics(Protocol):
    """The metrics of one flavor, already registered in a private registry."""

    def record_step(self, running: int, waiting: int, kv_usage: float) -> None: ...

    def record_prefix_query(self, queries: int, hits: int) -> None: ...

    def record_offload_query(self, queries: int, hits: int) -> None: ...

    def record_iteration(self, tokens: int, steps: int) -> None: ...

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
    cached_tokens: int
    num_preemptions: int
    max_tokens: int | None


@dataclass(frozen=True, slots=True)
class _Registries:
    """One engine's series, split by how often they change: most of the text is
    histograms, which change only when a request starts streaming or finishes, and series
    that never change after start; the rendering of each is kept until it changes (an
    engine is scraped every second)."""

    changing: CollectorRegistry  # gauges and counters: rendered at every scrape
    histograms: CollectorRegistry  # kept until a histogram changes
    fixed: CollectorRegistry  # rendered once

    @classmethod
    def new(cls) -> _Registries:
        return cls(CollectorRegistry(), CollectorRegistry(), CollectorRegistry())


class _VllmSeries:
    """Registers one engine's vLLM series, labelled ``model_name, engine`` (then the extra
    label of a ``*_by`` family), in one of ``EngineMetrics._build``'s registries.
    Histograms go to ``histograms`` unless ``per_step``: one observed every step would
    empty the kept rendering of that registry at every step."""

    def __init__(
        self,
        registry: CollectorRegistry,
        histograms: CollectorRegistry,
        model_name: str,
        engine_id: str,
    ) -> None:
        self.registry, self.histograms = registry, histograms
        self.values = (model_name, engine_id)

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, VLLM_LABELS, registry=self.registry).labels(*self.values)

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, VLLM_LABELS, registry=self.registry).labels(*self.values)

    def gauges_by(self, name: str, doc: str, label: str, keys: Sequence[str]) -> dict[str, Gauge]:
        family = Gauge(name, doc, [*VLLM_LABELS, label], registry=self.registry)
        return {key: family.labels(*self.values, key) for key in keys}

    def counters_by(
        self, name: str, doc: str, label: str, keys: Sequence[str]
    ) -> dict[str, Counter]:
        family = Counter(name, doc, [*VLLM_LABELS, label], registry=self.registry)
        return {key: family.labels(*self.values, key) for key in keys}

    def histogram(
        self, name: str, doc: str, buckets: Sequence[float], *, per_step: bool = False
    ) -> Histogram:
        registry = self.registry if per_step else self.histograms
        family = Histogram(name, doc, VLLM_LABELS, buckets=buckets, registry=registry)
        return family.labels(*self.values)


class _VllmMetrics:
    """vLLM V1's PrometheusStatLogger series for one engine index: vLLM 0.32's default set
    (no LoRA, speculative decoding, KV connector or KV-residency series)."""

    def __init__(
        self,
        registries: _Registries,
        model_name: str,
        engine_id: str,
        cache_config: Mapping[str, str],
        max_model_len: int,
    ) -> None:
        series = _VllmSeries(registries.changing, registries.histograms, model_name, engine_id)
        fixed = _VllmSeries(registries.fixed, registries.fixed, model_name, engine_id)
        _add_fixed_vllm_series(fixed, cache_config, max_model_len)
        self._add_scheduler_state(series)
        self._add_counters(series)
        self._add_count_histograms(series, build_1_2_5_buckets(max_model_len))
        self._add_time_histograms(series)

    def _add_scheduler_state(self, series: _VllmSeries) -> None:
        self.running = series.gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = series.gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.waiting_by_reason = series.gauges_by(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA "
            "budget, KV transfer, blocked status). Sum of all reasons equals "
            "vllm:num_requests_waiting.",
            "reason",
            VLLM_WAITING_REASONS,
        )
        self.kv_usage = series.gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )

    def _add_counters(self, series: _VllmSeries) -> None:
        self.prefix_queries = series.counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = series.counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.preemptions = series.counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = series.counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        by_source = series.counters_by(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            "source",
            VLLM_PROMPT_TOKEN_SOURCES,
        )
        self.prompt_computed = by_source["local_compute"]
        self.prompt_cache_hit = by_source["local_cache_hit"]
        self.prompt_cached = series.counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        # The GPU's hits are "device" hits; the offload tier's (CPU memory) "host" ones.
        cached_by_source = series.counters_by(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local "
            "HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM "
            "instance) or external_unspecified. Counted at admission; sums to "
            "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
            "source",
            VLLM_CACHE_HIT_SOURCES,
        )
        self.cached_on_device = cached_by_source["device"]
        self.cached_on_host = cached_by_source["host"]
        self.external_queries, self.external_hits = (
            series.counter(
                f"vllm:external_prefix_cache_{kind}",
                f"External prefix cache {kind} from KV connector cross-instance cache "
                f"sharing, in terms of number of {unit}.",
            )
            for kind, unit in (("queries", "queried tokens"), ("hits", "cached tokens"))
        )
        self.generation_tokens = series.counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.success = series.counters_by(
            "vllm:request_success",
            "Count of successfully processed requests.",
            "finished_reason",
            VLLM_FINISH_REASONS,
        )

    def _add_count_histograms(self, series: _VllmSeries, token_buckets: Sequence[float]) -> None:
        self.req_prompt_tokens = series.histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.req_generation_tokens = series.histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.iteration_tokens = series.histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            VLLM_ITERATION_TOKENS_BUCKETS,
            per_step=True,
        )
        self.max_generation_tokens = series.histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.params_n = series.histogram(
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            VLLM_REQUEST_PARAMS_N_BUCKETS,
        )
        self.params_max_tokens = series.histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.req_preemptions = series.histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            VLLM_REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )
        self.prefill_kv_computed = series.histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
        )

    def _add_time_histograms(self, series: _VllmSeries) -> None:
        self.ttft = series.histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            VLLM_TTFT_BUCKETS,
        )
        self.itl = series.histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            VLLM_TPOT_BUCKETS,
        )
        self.req_tpot = series.histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            VLLM_TPOT_BUCKETS,
        )
        latency = VLLM_REQUEST_LATENCY_BUCKETS
        self.e2e = series.histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            latency,
        )
        self.queue = series.histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            latency,
        )
        self.inference = series.histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            latency,
        )
        self.prefill = series.histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            latency,
        )
        self.decode = series.histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            latency,
        )

    def record_step(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        # Nothing defers a request here (no LoRA budget, KV transfer or blocked status):
        # every waiting request waits for capacity.
        self.waiting_by_reason["capacity"].set(waiting)
        self.kv_usage.set(kv_usage)

    def record_prefix_query(self, queries: int, hits: int) -> None:
        self.prefix_queries.inc(queries)
        self.prefix_hits.inc(hits)
        self.cached_on_device.inc(hits)

    def record_offload_query(self, queries: int, hits: int) -> None:
        self.external_queries.inc(queries)
        self.external_hits.inc(hits)
        self.cached_on_host.inc(hits)

    def record_iteration(self, tokens: int, steps: int) -> None:
        observe(self.iteration_tokens, tokens, steps)

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
        self._count_prompt(request.prompt_tokens, request.cached_tokens)
        self.generation_tokens.inc(request.generation_tokens)
        observe(self.req_prompt_tokens, request.prompt_tokens)
        observe(self.req_generation_tokens, request.generation_tokens)
        # Whatever its help says, vLLM observes the tokens generated here (the longest of
        # the request's n sequences), then n: the simulator answers n=1 only.
        observe(self.max_generation_tokens, request.generation_tokens)
        observe(self.params_n, 1)
        if request.max_tokens:  # vLLM skips a request without one
            observe(self.params_max_tokens, request.max_tokens)
        observe(self.req_preemptions, request.num_preemptions)
        observe(self.prefill_kv_computed, request.prompt_tokens - request.cached_tokens)
        observe_many(self.itl, request.inter_token_s)
        # vLLM leaves out the first token, which the prefill produced.
        decoded = request.generation_tokens - 1
        observe(self.req_tpot, request.decode_s / decoded if decoded > 0 else 0.0)
        observe(self.e2e, request.e2e_s)
        observe(self.queue, request.queue_s)
        observe(self.inference, request.prefill_s + request.decode_s)
        observe(self.prefill, request.prefill_s)
        observe(self.decode, request.decode_s)

    def _count_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        """vLLM's PromptTokenStats: computed + cache hits = all; no external KV transfer."""
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_computed.inc(prompt_tokens - cached_tokens)
        self.prompt_cache_hit.inc(cached_tokens)
        self.prompt_cached.inc(cached_tokens)


def _add_fixed_vllm_series(
    fixed: _VllmSeries, cache_config: Mapping[str, str], max_model_len: int
) -> None:
    """The vLLM series whose values the simulator never changes, as an idle feature of a
    real engine keeps them: MFU estimates (off unless --enable-mfu-metrics), the KV
    connector's and the multimodal caches (none here), the sleep state (never asleep), the
    frontend's queue-limit rejections (no limit), and the cache config."""
    model_name, engine_id = fixed.values
    for what, doc in (
        ("flops", "Estimated number of floating point operations per GPU"),
        ("read_bytes", "Estimated number of bytes read from memory per GPU"),
        ("write_bytes", "Estimated number of bytes written to memory per GPU"),
    ):
        fixed.counter(
            f"vllm:estimated_{what}_per_gpu_total",
            f"{doc} (for Model Flops Utilization calculations).",
        )
    for kind, unit in (("queries", "queried items"), ("hits", "cached items")):
        fixed.counter(
            f"vllm:mm_cache_{kind}", f"Multi-modal cache {kind}, in terms of number of {unit}."
        )
    fixed.gauges_by(
        "vllm:engine_sleep_state",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine "
        "is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
        "level 2.",
        "sleep_state",
        VLLM_SLEEP_STATES,
    )["awake"].set(1)
    # The frontend's counter: labelled by model only, no engine.
    rejections = Counter(
        "vllm:admission_rejections",
        "Number of admission attempts rejected by a queue limit, by reason.",
        ["model_name", "reason"],
        registry=fixed.registry,
    )
    for reason in VLLM_ADMISSION_REASONS:
        rejections.labels(model_name, reason)
    # An info-style gauge: the cache config fields plus "engine" as labels, value 1, and
    # no model_name label (vLLM's log_metrics_info).
    info = vllm_cache_config_info(cache_config, engine_id, max_model_len)
    Gauge(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        list(info),
        registry=fixed.registry,
    ).labels(**info).set(1)


def vllm_cache_config_info(
    cache_config: Mapping[str, str], engine_id: str, max_model_len: int
) -> dict[str, str]:
    """``vllm:cache_config_info``'s labels: every vLLM CacheConfig field, at vLLM's default
    unless ``cache_config`` gives it or the block size and count imply it, then ``engine``."""
    implied = _implied_by_kv_size(cache_config, max_model_len)
    return {**VLLM_CACHE_CONFIG_DEFAULTS, **implied, **cache_config, "engine": engine_id}


def _implied_by_kv_size(cache_config: Mapping[str, str], max_model_len: int) -> dict[str, str]:
    """What vLLM sets once its KV cache is allocated (``update_kv_cache_capacity``), for one
    full-attention group: a request of max_model_len holds ceil(max_model_len / block_size)
    blocks, so the pool serves num_gpu_blocks / that many at once."""
    try:
        block_size = int(cache_config["block_size"])
        num_blocks = int(cache_config["num_gpu_blocks"])
    except (KeyError, ValueError):
        return {}
    if block_size < 1:
        return {}
    concurrency = num_blocks / -(-max_model_len // block_size)
    return {
        # A block size other than vLLM's default had to be asked for with --block-size.
        "user_specified_block_size": str(block_size != VLLM_DEFAULT_BLOCK_SIZE),
        "effective_attention_block_size": str(block_size),
        "kv_cache_size_tokens": str(int(concurrency * max_model_len)),
        "kv_cache_max_concurrency": str(concurrency),
    }


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

    def record_offload_query(self, queries: int, hits: int) -> None:
        pass  # an SGLang-flavoured engine has no offload tier (EngineConfig)

    def record_iteration(self, tokens: int, steps: int) -> None:
        pass  # not exported in this flavor

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


def _tool_parser_invocations(registry: CollectorRegistry, model_name: str) -> Counter:
    """vLLM's API-server counter of tool parser runs (``vllm.parser.metrics``), present
    only with ``--tool-call-parser``: every label set made at start, no engine label."""
    family = Counter(
        "vllm:tool_call_parser_invocations",
        "Total number of ToolParser invocations. Non-streaming increments once per choice; "
        "streaming increments once per delta.",
        ["model_name", "mode", "outcome", "request_type"],
        registry=registry,
    )
    for mode in ("streaming", "non_streaming"):
        for outcome in ("tool_call", "no_tool_call"):
            for request_type in ("chat_completions", "responses", "other"):
                family.labels(model_name, mode, outcome, request_type)
    return family


class EngineMetrics:
    """The /metrics of one simulated engine, in vLLM's or SGLang's names.

    ``cache_config`` values are label values, formatted as vLLM formats them (``str()`` of
    the Python value: ``"True"``, ``"None"``, ``"0.9"``). The vllm flavor exports every key
    as a label of ``vllm:cache_config_info``, with vLLM's other CacheConfig fields
    (``VLLM_CACHE_CONFIG_DEFAULTS``, and the capacity ones ``block_size`` and
    ``num_gpu_blocks`` imply); the sglang flavor reads only
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
        tool_call_parser: bool = False,
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
        self._tool_call_parser = tool_call_parser
        self._build(start_time)

    def _build(self, start_time: float) -> None:
        registries = _Registries.new()
        metrics: _FlavorMetrics
        if self._flavor == "vllm":
            metrics = _VllmMetrics(
                registries,
                self._model_name,
                self._engine_id,
                self._cache_config,
                self._max_model_len,
            )
        else:
            metrics = _SglangMetrics(
                registries.changing, registries.histograms, self._model_name, self._cache_config
            )
        self._tool_parser_calls = (
            _tool_parser_invocations(registries.changing, self._model_name)
            if self._tool_call_parser and self._flavor == "vllm"
            else None
        )
        # prometheus_client's ProcessCollector would give every engine in this process the
        # same value, and a simulated restart could not move it.
        Gauge(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            registry=registries.fixed,
        ).set(start_time)
        self._registries, self._metrics = registries, metrics
        self._fixed_text = generate_latest(registries.fixed)
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

    def record_offload_query(self, queries: int, hits: int) -> None:
        """Once per request that looked in the offload tier: the prompt tokens beyond
        the GPU's hit looked up there, and those found (loaded back)."""
        self._metrics.record_offload_query(queries, hits)

    def record_iteration(self, tokens: int, steps: int = 1) -> None:
        """After a step (or ``steps`` alike) that produced tokens: ``tokens`` each, as vLLM
        counts them (the tokens sampled, plus the computed prompt tokens of each request
        whose prefill ended in it). Not kept with the other histograms' rendering: it
        changes every step."""
        self._metrics.record_iteration(tokens, steps)

    def record_preemption(self) -> None:
        self._metrics.record_preemption()

    def record_tool_parser(self, streaming: bool, called: bool) -> None:
        """A chat reply the tool parser read (once per reply; vLLM counts a stream once
        per delta)."""
        if self._tool_parser_calls is not None:
            outcome = "tool_call" if called else "no_tool_call"
            mode = "streaming" if streaming else "non_streaming"
            labels = (self._model_name, mode, outcome, "chat_completions")
            self._tool_parser_calls.labels(*labels).inc()

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
        *,
        cached_tokens: int = 0,
        num_preemptions: int = 0,
        max_tokens: int | None = None,
    ) -> None:
        """Once per request as it leaves the engine; ``finished_reason`` is stop|length|abort.
        ``cached_tokens``: the prompt tokens it found cached when first scheduled;
        ``max_tokens``: the request's parameter (None: it gave none)."""
        if not 0 <= cached_tokens <= prompt_tokens:
            raise ValueError(
                f"need 0 <= cached_tokens <= prompt_tokens, got cached_tokens={cached_tokens} "
                f"prompt_tokens={prompt_tokens}"
            )
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
                cached_tokens,
                num_preemptions,
                max_tokens,
            )
        )
        self._histogram_text = None

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        if self._histogram_text is None:
            self._histogram_text = generate_latest(self._registries.histograms)
        text = generate_latest(self._registries.changing) + self._fixed_text + self._histogram_text
        return text, CONTENT_TYPE_LATEST

    def reset(self, start_time: float) -> None:
        """A simulated restart: every series starts again from zero, with a new start time."""
        self._build(start_time)
