"""Histogram bounds of the engines the router's own histograms follow, so that its TTFT
and an engine's can be read side by side (vLLM V1 ``vllm/v1/metrics/loggers.py``; the
simulated engine's other bounds are ``bench/sim/metric_buckets.py``)."""

from __future__ import annotations

# vLLM's time-to-first-token buckets: cached (ms) to cold (minutes).
VLLM_TTFT_BUCKETS: tuple[float, ...] = (
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
)
