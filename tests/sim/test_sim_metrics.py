"""The simulated engine's /metrics: vLLM's and SGLang's names, labels, buckets and values."""

from __future__ import annotations

import functools
import math

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from bench.sim.config import Flavor
from bench.sim.engine import Engine, running_engine
from bench.sim.metric_buckets import build_1_2_5_buckets
from bench.sim.metrics import EngineMetrics, observe, observe_many
from bench.sim.request import SimRequest
from bench.textgen import text_for
from bench.tokenizer import encode_piece
from tests.conftest import TEST_MODEL, engine_config

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CACHE_CONFIG = {
    "block_size": "16",
    "cache_dtype": "auto",
    "enable_prefix_caching": "True",
    "gpu_memory_utilization": "0.9",
    "num_gpu_blocks": "2048",
}
VLLM_LABELS = {"model_name": MODEL, "engine": "0"}
SGLANG_SCHED_LABELS = {
    "model_name": MODEL,
    "engine_type": "unified",
    "tp_rank": "0",
    "pp_rank": "0",
    "moe_ep_rank": "0",
}
SGLANG_TOK_LABELS = {"model_name": MODEL, "engine_type": "unified"}


def _vllm(start_time: float = 1000.0, engine_id: str = "0") -> EngineMetrics:
    return EngineMetrics("vllm", MODEL, engine_id, CACHE_CONFIG, start_time, max_model_len=1000)


def _sglang(start_time: float = 1000.0) -> EngineMetrics:
    return EngineMetrics(
        "sglang", MODEL, "0", {**CACHE_CONFIG, "max_total_num_tokens": "32768"}, start_time
    )


def _families(metrics: EngineMetrics) -> dict[str, Metric]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {family.name: family for family in text_string_to_metric_families(body.decode())}


def _value(families: dict[str, Metric], sample_name: str, **labels: str) -> float:
    family_name = sample_name.removesuffix("_total")
    for suffix in ("_bucket", "_count", "_sum"):
        if family_name not in families:
            family_name = family_name.removesuffix(suffix)
    matches = [
        s.value
        for s in families[family_name].samples
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(matches) == 1, f"{sample_name} {labels}: {matches}"
    return matches[0]


def _bucket_bounds(family: Metric) -> list[float]:
    return [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]


def _label_names(family: Metric, sample_name: str) -> set[str]:
    return {name for s in family.samples if s.name == sample_name for name in s.labels}


def test_vllm_families_have_vllm_names_types_and_labels() -> None:
    families = _families(_vllm())
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:request_prompt_tokens": "histogram",
        "vllm:request_generation_tokens": "histogram",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:request_time_per_output_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_inference_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram",
        "vllm:request_decode_time_seconds": "histogram",
        "vllm:cache_config_info": "gauge",
        "process_start_time_seconds": "gauge",
        # Added with vLLM 0.32's set.
        "vllm:estimated_flops_per_gpu": "counter",
        "vllm:estimated_read_bytes_per_gpu": "counter",
        "vllm:estimated_write_bytes_per_gpu": "counter",
        "vllm:num_requests_waiting_by_reason": "gauge",
        "vllm:engine_sleep_state": "gauge",
        "vllm:external_prefix_cache_queries": "counter",
        "vllm:external_prefix_cache_hits": "counter",
        "vllm:mm_cache_queries": "counter",
        "vllm:mm_cache_hits": "counter",
        "vllm:prompt_tokens_by_source": "counter",
        "vllm:prompt_tokens_cached": "counter",
        "vllm:prompt_tokens_cached_by_source": "counter",
        "vllm:admission_rejections": "counter",
        "vllm:iteration_tokens_total": "histogram",
        "vllm:request_max_num_generation_tokens": "histogram",
        "vllm:request_params_n": "histogram",
        "vllm:request_params_max_tokens": "histogram",
        "vllm:request_num_preemptions": "histogram",
        "vllm:request_prefill_kv_computed_tokens": "histogram",
    }
    for name, kind in expected.items():
        assert families[name].type == kind, name
    assert not [name for name in families if name.startswith("sglang:")]
    extra_label = {
        "vllm:num_requests_waiting_by_reason": "reason",
        "vllm:engine_sleep_state": "sleep_state",
        "vllm:prompt_tokens_by_source_total": "source",
        "vllm:prompt_tokens_cached_by_source_total": "source",
    }
    for sample_name, label in extra_label.items():
        family = families[sample_name.removesuffix("_total")]
        assert _label_names(family, sample_name) == {"model_name", "engine", label}
    # The frontend's counter: no engine label.
    assert _label_names(
        families["vllm:admission_rejections"], "vllm:admission_rejections_total"
    ) == {"model_name", "reason"}
    assert _label_names(families["vllm:num_requests_running"], "vllm:num_requests_running") == {
        "model_name",
        "engine",
    }
    assert _label_names(families["vllm:request_success"], "vllm:request_success_total") == {
        "model_name",
        "engine",
        "finished_reason",
    }
    assert families["vllm:time_to_first_token_seconds"].documentation == (
        "Histogram of time to first token in seconds."
    )
    assert families["vllm:kv_cache_usage_perc"].documentation == (
        "KV-cache usage. 1 means 100 percent usage."
    )


def test_vllm_bucket_bounds_match_vllm() -> None:
    families = _families(_vllm())
    ttft = [
        0.001,
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.25,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
        160.0,
        640.0,
        2560.0,
        math.inf,
    ]
    tpot = [
        0.01,
        0.025,
        0.05,
        0.075,
        0.1,
        0.15,
        0.2,
        0.3,
        0.4,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
        math.inf,
    ]
    latency = [
        0.3,
        0.5,
        0.8,
        1.0,
        1.5,
        2.0,
        2.5,
        5.0,
        10.0,
        15.0,
        20.0,
        30.0,
        40.0,
        50.0,
        60.0,
        120.0,
        240.0,
        480.0,
        960.0,
        1920.0,
        7680.0,
        math.inf,
    ]
    assert _bucket_bounds(families["vllm:time_to_first_token_seconds"]) == ttft
    assert _bucket_bounds(families["vllm:inter_token_latency_seconds"]) == tpot
    assert _bucket_bounds(families["vllm:request_time_per_output_token_seconds"]) == tpot
    for name in (
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_inference_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
    ):
        assert _bucket_bounds(families[f"vllm:{name}"]) == latency, name
    tokens = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, math.inf]
    for name in (
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_max_num_generation_tokens",
        "request_params_max_tokens",
        "request_prefill_kv_computed_tokens",
    ):
        assert _bucket_bounds(families[f"vllm:{name}"]) == tokens, name
    assert _bucket_bounds(families["vllm:iteration_tokens_total"]) == [
        *(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
        math.inf,
    ]
    assert _bucket_bounds(families["vllm:request_params_n"]) == [1, 2, 5, 10, 20, math.inf]
    assert _bucket_bounds(families["vllm:request_num_preemptions"]) == [
        *(1, 2, 3, 4, 5, 10, 20),
        math.inf,
    ]


def test_build_1_2_5_buckets_matches_vllm_docstring() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]


# vLLM 0.32's CacheConfig fields, as its /metrics lists them on vllm:cache_config_info.
VLLM_CACHE_CONFIG_FIELDS = {
    *("_block_size_resolved", "block_size", "cache_dtype", "cache_hit_alignment_tokens"),
    *("effective_attention_block_size", "enable_mamba_shared_prefix_checkpoint"),
    *("enable_prefix_caching", "gpu_memory_utilization", "hash_block_size"),
    *("is_attention_free", "kv_cache_dtype_skip_layers", "kv_cache_layout"),
    *("kv_cache_max_concurrency", "kv_cache_memory_bytes", "kv_cache_size_tokens"),
    *("kv_offloading_backend", "kv_offloading_size", "kv_sharing_fast_prefill"),
    *("mamba_block_size", "mamba_cache_dtype", "mamba_cache_mode", "mamba_page_size_padded"),
    *("mamba_ssm_cache_dtype", "num_cpu_blocks", "num_gpu_blocks", "num_gpu_blocks_override"),
    *("prefix_cache_retention_interval", "prefix_caching_hash_algo", "prefix_match_unit"),
    *("replayssm_buffer_len", "skip_page_size_padded", "sliding_window", "swa_bounded_replay"),
    *("use_kda_recoverssm", "use_replayssm", "user_specified_block_size"),
}


def test_vllm_cache_config_info_has_every_cache_config_field_plus_engine() -> None:
    family = _families(_vllm(engine_id="3"))["vllm:cache_config_info"]
    assert family.documentation == "Information of the LLMEngine CacheConfig"
    [sample] = family.samples
    assert set(sample.labels) == {*VLLM_CACHE_CONFIG_FIELDS, "engine"}
    assert sample.value == 1.0
    # Given keys as given; the rest at vLLM's defaults, formatted as str() formats them.
    assert sample.labels == sample.labels | CACHE_CONFIG | {"engine": "3"}
    assert sample.labels["kv_cache_dtype_skip_layers"] == "[]"
    assert sample.labels["mamba_cache_mode"] == "none"
    assert sample.labels["prefix_cache_retention_interval"] == "0"
    assert sample.labels["kv_offloading_size"] == "None"
    # What 2048 blocks of 16 imply at max_model_len 1000: 63 blocks a request (the last
    # one partly used), 2048 / 63 requests at once, and that many max_model_lens of tokens.
    assert sample.labels["effective_attention_block_size"] == "16"
    assert sample.labels["kv_cache_max_concurrency"] == str(2048 / 63)
    assert sample.labels["kv_cache_size_tokens"] == str(int(2048 / 63 * 1000))
    assert sample.labels["user_specified_block_size"] == "False"  # vLLM's default block size


def test_vllm_cache_config_info_matches_real_vllm_for_the_same_pool() -> None:
    """The labels a vLLM 0.32 engine with --block-size 32 --num-gpu-blocks-override 128
    --max-model-len 2048 shows (read from one), for the facts the simulator shares."""
    config = {"block_size": "32", "num_gpu_blocks": "128", "num_gpu_blocks_override": "128"}
    metrics = EngineMetrics("vllm", MODEL, "0", config, 1.0, max_model_len=2048)
    [sample] = _families(metrics)["vllm:cache_config_info"].samples
    assert {k: sample.labels[k] for k in sorted(sample.labels) if "kv_cache_" in k} == {
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": "2.0",
        "kv_cache_memory_bytes": "None",  # 1073741824 on the CPU build: its KV space
        "kv_cache_size_tokens": "4096",
    }
    assert sample.labels["user_specified_block_size"] == "True"
    assert sample.labels["effective_attention_block_size"] == "32"
    assert sample.labels["_block_size_resolved"] == "True"


def test_vllm_values_follow_recorded_calls() -> None:
    metrics = _vllm()
    metrics.record_step(running=3, waiting=2, kv_usage=0.25)
    metrics.record_prefix_query(queries=100, hits=40)
    metrics.record_prefix_query(queries=60, hits=0)
    metrics.record_preemption()
    metrics.record_preemption()
    metrics.record_first_token(0.03)
    metrics.record_finished(
        "stop",
        prompt_tokens=120,
        generation_tokens=10,
        e2e_s=2.0,
        queue_s=0.5,
        prefill_s=0.3,
        decode_s=1.2,
        inter_token_s=[0.1] * 9,
    )
    metrics.record_finished(
        "length",
        prompt_tokens=7,
        generation_tokens=1,
        e2e_s=0.4,
        queue_s=0.0,
        prefill_s=0.4,
        decode_s=0.0,
        inter_token_s=[],
    )
    f = _families(metrics)
    lbl = VLLM_LABELS
    assert _value(f, "vllm:num_requests_running", **lbl) == 3
    assert _value(f, "vllm:num_requests_waiting", **lbl) == 2
    assert _value(f, "vllm:kv_cache_usage_perc", **lbl) == 0.25
    assert _value(f, "vllm:prefix_cache_queries_total", **lbl) == 160
    assert _value(f, "vllm:prefix_cache_hits_total", **lbl) == 40
    assert _value(f, "vllm:num_preemptions_total", **lbl) == 2
    assert _value(f, "vllm:prompt_tokens_total", **lbl) == 127
    assert _value(f, "vllm:generation_tokens_total", **lbl) == 11
    for reason, count in {"stop": 1, "length": 1, "abort": 0, "error": 0}.items():
        assert _value(f, "vllm:request_success_total", finished_reason=reason, **lbl) == count
    ttft = "vllm:time_to_first_token_seconds"
    assert _value(f, f"{ttft}_bucket", le="0.02", **lbl) == 0
    assert _value(f, f"{ttft}_bucket", le="0.04", **lbl) == 1
    assert _value(f, f"{ttft}_sum", **lbl) == pytest.approx(0.03)
    assert _value(f, "vllm:inter_token_latency_seconds_count", **lbl) == 9
    assert _value(f, "vllm:inter_token_latency_seconds_sum", **lbl) == pytest.approx(0.9)
    # Mean TPOT leaves out the prefill's token: 1.2 s over 9 tokens; 0 for a 1-token request.
    tpot = "vllm:request_time_per_output_token_seconds"
    assert _value(f, f"{tpot}_sum", **lbl) == pytest.approx(1.2 / 9)
    assert _value(f, f"{tpot}_count", **lbl) == 2
    assert _value(f, "vllm:e2e_request_latency_seconds_sum", **lbl) == pytest.approx(2.4)
    assert _value(f, "vllm:e2e_request_latency_seconds_bucket", le="0.5", **lbl) == 1
    assert _value(f, "vllm:request_queue_time_seconds_sum", **lbl) == pytest.approx(0.5)
    assert _value(f, "vllm:request_prefill_time_seconds_sum", **lbl) == pytest.approx(0.7)
    assert _value(f, "vllm:request_decode_time_seconds_sum", **lbl) == pytest.approx(1.2)
    assert _value(f, "vllm:request_inference_time_seconds_sum", **lbl) == pytest.approx(1.9)
    assert _value(f, "vllm:request_prompt_tokens_bucket", le="100.0", **lbl) == 1
    assert _value(f, "vllm:request_prompt_tokens_bucket", le="200.0", **lbl) == 2
    assert _value(f, "vllm:request_generation_tokens_sum", **lbl) == 11
    assert _value(f, "process_start_time_seconds") == 1000.0


def test_vllm_added_series_follow_recorded_calls() -> None:
    metrics = _vllm()
    metrics.record_step(running=1, waiting=4, kv_usage=0.5)
    metrics.record_prefix_query(queries=100, hits=48)
    metrics.record_iteration(53)  # a step that ended a 52-token prefill and sampled 1
    metrics.record_iteration(2, steps=30)  # a 30-step span decoding 2 requests
    metrics.record_finished(
        "stop", 100, 31, 2.0, 0.5, 0.3, 1.2, [0.04] * 30,
        cached_tokens=48, num_preemptions=2, max_tokens=500,
    )  # fmt: skip
    metrics.record_finished("length", 7, 3, 0.4, 0.0, 0.2, 0.2, [0.1] * 2, max_tokens=3)
    metrics.record_finished("abort", 9, 0, 0.1, 0.1, 0.0, 0.0, [])  # gave no max_tokens
    f, lbl = _families(metrics), VLLM_LABELS
    waiting = "vllm:num_requests_waiting_by_reason"
    assert _value(f, waiting, reason="capacity", **lbl) == 4
    assert _value(f, waiting, reason="deferred", **lbl) == 0
    sleep = "vllm:engine_sleep_state"
    assert _value(f, sleep, sleep_state="awake", **lbl) == 1
    assert _value(f, sleep, sleep_state="weights_offloaded", **lbl) == 0
    assert _value(f, sleep, sleep_state="discard_all", **lbl) == 0
    # Prompt tokens split into computed and cached; the tiers count the admission's hits.
    by_source = "vllm:prompt_tokens_by_source_total"
    assert _value(f, "vllm:prompt_tokens_total", **lbl) == 116
    assert _value(f, by_source, source="local_compute", **lbl) == 116 - 48
    assert _value(f, by_source, source="local_cache_hit", **lbl) == 48
    assert _value(f, by_source, source="external_kv_transfer", **lbl) == 0
    assert _value(f, "vllm:prompt_tokens_cached_total", **lbl) == 48
    cached_by = "vllm:prompt_tokens_cached_by_source_total"
    assert _value(f, cached_by, source="device", **lbl) == 48
    for tier in ("host", "p2p", "disk", "external_unspecified"):
        assert _value(f, cached_by, source=tier, **lbl) == 0
    iteration = "vllm:iteration_tokens_total"
    assert _value(f, f"{iteration}_count", **lbl) == 31
    assert _value(f, f"{iteration}_sum", **lbl) == 53 + 60
    assert _value(f, f"{iteration}_bucket", le="1.0", **lbl) == 0
    assert _value(f, f"{iteration}_bucket", le="8.0", **lbl) == 30
    assert _value(f, f"{iteration}_bucket", le="64.0", **lbl) == 31
    preemptions = "vllm:request_num_preemptions"
    assert _value(f, f"{preemptions}_sum", **lbl) == 2
    assert _value(f, f"{preemptions}_bucket", le="1.0", **lbl) == 2
    assert _value(f, f"{preemptions}_bucket", le="2.0", **lbl) == 3
    # max_tokens only where given; n is 1 for every request.
    assert _value(f, "vllm:request_params_max_tokens_count", **lbl) == 2
    assert _value(f, "vllm:request_params_max_tokens_sum", **lbl) == 503
    assert _value(f, "vllm:request_params_n_count", **lbl) == 3
    assert _value(f, "vllm:request_params_n_bucket", le="1.0", **lbl) == 3
    assert _value(f, "vllm:request_max_num_generation_tokens_sum", **lbl) == 34
    assert _value(f, "vllm:request_prefill_kv_computed_tokens_sum", **lbl) == 52 + 7 + 9
    assert _value(f, "vllm:request_prefill_kv_computed_tokens_bucket", le="5.0", **lbl) == 0
    assert _value(f, "vllm:request_prefill_kv_computed_tokens_bucket", le="10.0", **lbl) == 2
    assert _value(f, "vllm:request_success_total", finished_reason="repetition", **lbl) == 0
    for name in ("estimated_flops_per_gpu", "external_prefix_cache_hits", "mm_cache_queries"):
        assert _value(f, f"vllm:{name}_total", **lbl) == 0
    for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
        assert _value(f, "vllm:admission_rejections_total", model_name=MODEL, reason=reason) == 0


async def _finish(request: SimRequest) -> None:
    while not request.finished:
        await request.next_update()


def _stall_at_first_token(engine: Engine, request: SimRequest) -> bool:
    """A listener that stalls ``engine`` as ``request``'s first token comes out, so the
    test acts before the next step however late its task runs."""
    engine.faults.update({"stall": True})
    request.listener = None
    return False  # wake the request's waiter


async def test_a_simulated_engine_feeds_the_added_vllm_series() -> None:
    """One request alone, then one with the same prompt (a cache hit, stopping before its
    max_tokens), then one preempted mid-decode: the values vLLM would show for them."""
    prompt = encode_piece(text_for("metrics", 200))  # 200 tokens: 12 full blocks of 16
    async with running_engine(engine_config(time_scale=50.0)) as engine:
        await _finish(engine.submit(prompt, 20, True))
        second = engine.submit(prompt, 1000, False, seed=7)
        await _finish(second)
        third = engine.submit(encode_piece(text_for("other", 100)), 40, True)
        third.listener = functools.partial(_stall_at_first_token, engine)
        await third.next_update()
        assert third.output_tokens == 1
        assert engine.reset_prefix_cache(reset_running=True)
        engine.faults.update({"stall": False})
        await _finish(third)
        f = _families(engine.metrics)
    assert second.finish_reason == "stop" and second.output_tokens < 1000
    lbl = {"model_name": TEST_MODEL, "engine": "0"}
    cached = 192  # the second request's: every full block but the one holding its last token
    computed = 200 + (200 - cached) + 100
    generated = 20 + second.output_tokens + 40
    assert second.cached_tokens == cached
    by_source = "vllm:prompt_tokens_by_source_total"
    assert _value(f, by_source, source="local_compute", **lbl) == computed
    assert _value(f, by_source, source="local_cache_hit", **lbl) == cached
    assert _value(f, "vllm:prompt_tokens_cached_total", **lbl) == cached
    cached_by = "vllm:prompt_tokens_cached_by_source_total"
    assert _value(f, cached_by, source="device", **lbl) == cached
    assert _value(f, "vllm:request_prefill_kv_computed_tokens_sum", **lbl) == computed
    # One request at a time: every step that produced a token produced one, and the first
    # token's step also counts the prompt it computed (not the preempted one's recompute).
    assert _value(f, "vllm:iteration_tokens_total_count", **lbl) == generated
    assert _value(f, "vllm:iteration_tokens_total_sum", **lbl) == computed + generated
    assert _value(f, "vllm:request_params_max_tokens_sum", **lbl) == 20 + 1000 + 40
    assert _value(f, "vllm:request_max_num_generation_tokens_sum", **lbl) == generated
    assert _value(f, "vllm:request_params_n_sum", **lbl) == 3
    assert _value(f, "vllm:num_preemptions_total", **lbl) == 1
    assert _value(f, "vllm:request_num_preemptions_sum", **lbl) == 1
    assert _value(f, "vllm:request_num_preemptions_count", **lbl) == 3
    assert _value(f, "vllm:num_requests_waiting_by_reason", reason="capacity", **lbl) == 0
    [info] = f["vllm:cache_config_info"].samples
    assert info.labels["num_gpu_blocks"] == str(engine.num_blocks)
    assert info.labels["kv_cache_size_tokens"] == str(
        int(engine.num_blocks / -(-engine.max_model_len // 16) * engine.max_model_len)
    )


def test_vllm_rejects_unknown_reason_and_impossible_hits() -> None:
    metrics = _vllm()
    with pytest.raises(ValueError, match="stop, length, abort"):
        metrics.record_finished("timeout", 1, 1, 0.1, 0.0, 0.1, 0.0, [])
    with pytest.raises(ValueError, match="hits <= queries"):
        metrics.record_prefix_query(queries=10, hits=11)
    with pytest.raises(ValueError, match="cached_tokens <= prompt_tokens"):
        metrics.record_finished("stop", 10, 1, 0.1, 0.0, 0.1, 0.0, [], cached_tokens=11)


def test_sglang_flavor_emits_sglang_names_labels_and_buckets() -> None:
    families = _families(_sglang())
    assert not [name for name in families if name.startswith("vllm:")]
    expected = {
        "sglang:num_running_reqs": "gauge",
        "sglang:num_queue_reqs": "gauge",
        "sglang:token_usage": "gauge",
        "sglang:cache_hit_rate": "gauge",
        "sglang:max_total_num_tokens": "gauge",
        "sglang:num_retracted_requests": "counter",
        "sglang:prompt_tokens": "counter",
        "sglang:generation_tokens": "counter",
        "sglang:cached_tokens": "counter",
        "sglang:num_requests": "counter",
        "sglang:num_aborted_requests": "counter",
        "sglang:time_to_first_token_seconds": "histogram",
        "sglang:inter_token_latency_seconds": "histogram",
        "sglang:e2e_request_latency_seconds": "histogram",
        "sglang:queue_time_seconds": "histogram",
        "process_start_time_seconds": "gauge",
    }
    for name, kind in expected.items():
        assert families[name].type == kind, name
    assert _label_names(families["sglang:num_running_reqs"], "sglang:num_running_reqs") == set(
        SGLANG_SCHED_LABELS
    )
    assert _label_names(families["sglang:prompt_tokens"], "sglang:prompt_tokens_total") == set(
        SGLANG_TOK_LABELS
    )
    assert _bucket_bounds(families["sglang:time_to_first_token_seconds"]) == [
        0.1,
        0.2,
        0.4,
        0.6,
        0.8,
        1,
        2,
        4,
        6,
        8,
        10,
        20,
        40,
        60,
        80,
        100,
        200,
        400,
        math.inf,
    ]
    assert _bucket_bounds(families["sglang:e2e_request_latency_seconds"]) == [
        0.1,
        0.2,
        0.4,
        0.6,
        0.8,
        1,
        2,
        4,
        6,
        8,
        10,
        20,
        40,
        60,
        80,
        100,
        200,
        400,
        600,
        1200,
        1800,
        2400,
        math.inf,
    ]
    assert _bucket_bounds(families["sglang:inter_token_latency_seconds"])[:3] == [
        0.002,
        0.004,
        0.006,
    ]
    assert _bucket_bounds(families["sglang:queue_time_seconds"])[:3] == [0.0, 0.1, 0.2]
    assert families["sglang:cache_hit_rate"].documentation == "The prefix cache hit rate."
    assert _value(families, "sglang:max_total_num_tokens", **SGLANG_SCHED_LABELS) == 32768


def test_sglang_values_follow_recorded_calls() -> None:
    metrics = _sglang()
    metrics.record_prefix_query(queries=100, hits=75)
    metrics.record_prefix_query(queries=100, hits=25)
    metrics.record_step(running=4, waiting=1, kv_usage=0.6)
    metrics.record_preemption()
    metrics.record_first_token(0.5)
    metrics.record_finished(
        "stop",
        200,
        5,
        e2e_s=3.0,
        queue_s=0.15,
        prefill_s=0.4,
        decode_s=2.0,
        inter_token_s=[0.03] * 4,
    )
    metrics.record_finished(
        "abort", 50, 2, e2e_s=1.0, queue_s=0.0, prefill_s=0.2, decode_s=0.1, inter_token_s=[0.05]
    )
    f = _families(metrics)
    sched, tok = SGLANG_SCHED_LABELS, SGLANG_TOK_LABELS
    assert _value(f, "sglang:num_running_reqs", **sched) == 4
    assert _value(f, "sglang:num_queue_reqs", **sched) == 1
    assert _value(f, "sglang:token_usage", **sched) == 0.6
    assert _value(f, "sglang:cache_hit_rate", **sched) == 0.5
    assert _value(f, "sglang:num_retracted_requests_total", **sched) == 1
    assert _value(f, "sglang:cached_tokens_total", **tok) == 100
    assert _value(f, "sglang:prompt_tokens_total", **tok) == 250
    assert _value(f, "sglang:generation_tokens_total", **tok) == 7
    assert _value(f, "sglang:num_requests_total", **tok) == 2
    assert _value(f, "sglang:num_aborted_requests_total", **tok) == 1
    assert _value(f, "sglang:time_to_first_token_seconds_bucket", le="0.4", **tok) == 0
    assert _value(f, "sglang:time_to_first_token_seconds_bucket", le="0.6", **tok) == 1
    assert _value(f, "sglang:inter_token_latency_seconds_count", **tok) == 5
    assert _value(f, "sglang:inter_token_latency_seconds_sum", **tok) == pytest.approx(0.17)
    assert _value(f, "sglang:e2e_request_latency_seconds_sum", **tok) == pytest.approx(4.0)
    assert _value(f, "sglang:queue_time_seconds_bucket", le="0.1", **sched) == 1
    assert _value(f, "sglang:queue_time_seconds_bucket", le="0.2", **sched) == 2


def test_sglang_cache_hit_rate_is_per_batch_and_held_between_batches() -> None:
    metrics = _sglang()
    metrics.record_prefix_query(queries=100, hits=80)
    metrics.record_step(1, 0, 0.1)
    assert _value(_families(metrics), "sglang:cache_hit_rate", **SGLANG_SCHED_LABELS) == 0.8
    metrics.record_step(1, 0, 0.1)  # a decode-only step
    assert _value(_families(metrics), "sglang:cache_hit_rate", **SGLANG_SCHED_LABELS) == 0.8
    metrics.record_prefix_query(queries=50, hits=0)
    metrics.record_step(2, 0, 0.2)
    assert _value(_families(metrics), "sglang:cache_hit_rate", **SGLANG_SCHED_LABELS) == 0.0


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_reset_zeroes_counters_and_moves_start_time(flavor: str) -> None:
    metrics = _vllm() if flavor == "vllm" else _sglang()
    metrics.record_step(5, 5, 0.9)
    metrics.record_prefix_query(10, 5)
    metrics.record_preemption()
    metrics.record_first_token(0.2)
    metrics.record_finished("stop", 10, 3, 1.0, 0.1, 0.2, 0.7, [0.3, 0.4])
    metrics.reset(start_time=2000.0)
    f = _families(metrics)
    assert _value(f, "process_start_time_seconds") == 2000.0
    if flavor == "vllm":
        assert _value(f, "vllm:prompt_tokens_total", **VLLM_LABELS) == 0
        assert _value(f, "vllm:num_preemptions_total", **VLLM_LABELS) == 0
        assert _value(f, "vllm:prefix_cache_queries_total", **VLLM_LABELS) == 0
        assert _value(f, "vllm:request_success_total", finished_reason="stop", **VLLM_LABELS) == 0
        assert _value(f, "vllm:time_to_first_token_seconds_count", **VLLM_LABELS) == 0
        assert _value(f, "vllm:num_requests_running", **VLLM_LABELS) == 0
        assert _value(f, "vllm:cache_config_info", engine="0") == 1
    else:
        assert _value(f, "sglang:prompt_tokens_total", **SGLANG_TOK_LABELS) == 0
        assert _value(f, "sglang:num_requests_total", **SGLANG_TOK_LABELS) == 0
        assert _value(f, "sglang:num_retracted_requests_total", **SGLANG_SCHED_LABELS) == 0
        assert _value(f, "sglang:e2e_request_latency_seconds_count", **SGLANG_TOK_LABELS) == 0
        assert _value(f, "sglang:cache_hit_rate", **SGLANG_SCHED_LABELS) == 0


def test_two_instances_do_not_share_state() -> None:
    first, second = _vllm(start_time=10.0), _vllm(start_time=20.0, engine_id="1")
    first.record_finished("stop", 100, 10, 1.0, 0.1, 0.2, 0.7, [])
    first.record_step(7, 0, 0.5)
    f1, f2 = _families(first), _families(second)
    assert _value(f1, "vllm:prompt_tokens_total", **VLLM_LABELS) == 100
    assert _value(f2, "vllm:prompt_tokens_total", model_name=MODEL, engine="1") == 0
    assert _value(f2, "vllm:num_requests_running", model_name=MODEL, engine="1") == 0
    assert _value(f1, "process_start_time_seconds") == 10.0
    assert _value(f2, "process_start_time_seconds") == 20.0
    # And neither touched the global registry.
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("vllm:prompt_tokens_total", VLLM_LABELS) is None


def _twin_histograms(
    bounds: tuple[float, ...],
) -> tuple[tuple[Histogram, CollectorRegistry], tuple[Histogram, CollectorRegistry]]:
    """Two identical histograms, each in a registry of its own."""
    pair = []
    for _ in range(2):
        registry = CollectorRegistry()
        pair.append((Histogram("h", "h", buckets=bounds, registry=registry), registry))
    return pair[0], pair[1]


def _lines(registry: CollectorRegistry) -> list[str]:
    return [
        line for line in generate_latest(registry).decode().splitlines() if "_created" not in line
    ]


def test_observe_matches_prometheus_observe() -> None:
    values = [0.0, 0.01, 0.0100001, 0.025, 0.3, 10.0, 10.5, 1e9, 3, *(0.001 * i for i in range(60))]
    (theirs, theirs_registry), (ours, ours_registry) = _twin_histograms(
        (0.01, 0.025, 0.05, 0.5, 10.0)
    )
    for value in values:
        theirs.observe(value)
        observe(ours, value)
    assert _lines(ours_registry) == _lines(theirs_registry)


def test_observe_times_matches_observing_that_often() -> None:
    (theirs, theirs_registry), (ours, ours_registry) = _twin_histograms((1, 8, 16, 32))
    for value, times in ((1, 3), (8, 1), (9, 40), (33, 2), (0, 5)):
        for _ in range(times):
            theirs.observe(value)
        observe(ours, value, times)
    assert _lines(ours_registry) == _lines(theirs_registry)


def test_observe_many_matches_observe_one_by_one() -> None:
    values = [0.0, 0.01, 0.0125, 0.04, 0.04, 0.3, 7.5, 1e9, *(0.001 * i for i in range(500))]
    (one_by_one, one_by_one_registry), (bulk, bulk_registry) = _twin_histograms(
        (0.01, 0.025, 0.05, 0.5, 10.0)
    )
    for value in values:
        one_by_one.observe(value)
    observe_many(bulk, values)

    def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
        text = generate_latest(registry).decode()
        return {
            (s.name, s.labels.get("le", "")): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if not s.name.endswith("_created")
        }

    assert samples(bulk_registry) == pytest.approx(samples(one_by_one_registry), rel=1e-12)


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_a_render_after_a_change_shows_it(flavor: Flavor) -> None:
    """Histogram text is kept between renders; every change must still show."""
    metrics = EngineMetrics(flavor, "m", "0", {"block_size": "16", "num_gpu_blocks": "8"}, 1.0)

    def ttft_count() -> float:
        text = metrics.render()[0].decode()
        return next(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name.endswith("time_to_first_token_seconds_count")
        )

    assert ttft_count() == 0
    metrics.record_first_token(0.5)
    assert ttft_count() == 1
    metrics.record_step(1, 0, 0.5)
    assert ttft_count() == 1
    metrics.record_first_token(0.25)
    assert ttft_count() == 2
    metrics.reset(2.0)
    assert ttft_count() == 0
