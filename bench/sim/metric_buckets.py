"""Histogram bucket bounds of vLLM's and SGLang's engine metrics, as their sources set them
(vLLM V1 ``vllm/v1/metrics/buckets.py`` and ``loggers.py``, SGLang
``python/sglang/srt/metrics/collector.py``).
"""

from __future__ import annotations

# vLLM's TTFT bounds are router/wire/buckets.py's: the router's histograms share them.

# Shared by vllm:inter_token_latency_seconds and vllm:request_time_per_output_token_seconds.
VLLM_TPOT_BUCKETS: tuple[float, ...] = (
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
)
# Shared by the e2e, queue, inference, prefill and decode time histograms.
VLLM_REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
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
)
# vllm:iteration_tokens_total: tokens per engine step, powers of two up to a typical
# max_num_batched_tokens.
VLLM_ITERATION_TOKENS_BUCKETS: tuple[float, ...] = (
    1,
    8,
    16,
    32,
    64,
    128,
    256,
    512,
    1024,
    2048,
    4096,
    8192,
    16384,
)
VLLM_REQUEST_PARAMS_N_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20)
# vllm:request_num_preemptions: every finished request is observed, so the first bucket
# holds the never-preempted ones together with the once-preempted.
VLLM_REQUEST_NUM_PREEMPTIONS_BUCKETS: tuple[float, ...] = (1, 2, 3, 4, 5, 10, 20)

SGLANG_TTFT_BUCKETS: tuple[float, ...] = (
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
)
SGLANG_ITL_BUCKETS: tuple[float, ...] = (
    0.002,
    0.004,
    0.006,
    0.008,
    0.010,
    0.015,
    0.020,
    0.025,
    0.030,
    0.035,
    0.040,
    0.060,
    0.080,
    0.100,
    0.200,
    0.400,
    0.600,
    0.800,
    1.000,
    2.000,
    4.000,
    6.000,
    8.000,
)
# SGLang's end-to-end bounds are its TTFT bounds carried on to 40 minutes.
SGLANG_E2E_BUCKETS: tuple[float, ...] = (*SGLANG_TTFT_BUCKETS, 600, 1200, 1800, 2400)
SGLANG_QUEUE_TIME_BUCKETS: tuple[float, ...] = (
    0.0,
    0.1,
    0.2,
    0.5,
    1,
    2,
    3,
    4,
    5,
    10,
    15,
    20,
    30,
    40,
    50,
    60,
    70,
    80,
    90,
    100,
    200,
    300,
    400,
    500,
    600,
    700,
    800,
    900,
    1000,
    1200,
    1400,
    1600,
    1800,
    2000,
    2500,
    3000,
)


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to and including ``max_value``, as vLLM builds them."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return buckets
            buckets.append(float(value))
        scale *= 10
