"""Real vLLM engines for the tests; their home is ``bench/real/vllm_cpu.py`` (the benchmark
``kvrouter bench real`` starts the same engines), re-exported here under the names the
tests import."""

from __future__ import annotations

from bench.ports import free_ports
from bench.real.vllm_cpu import (
    BLOCK_TOKENS,
    GENERATION_CONFIG,
    MAX_MODEL_LEN,
    MODEL_NAME,
    NUM_BLOCKS,
    QWEN3_TINY,
    START_TIMEOUT_S,
    VLLM_VERSION,
    VllmEngine,
    install_vllm,
    reset_prefix_caches,
    start_engines,
    write_model,
)

__all__ = [
    "BLOCK_TOKENS",
    "GENERATION_CONFIG",
    "MAX_MODEL_LEN",
    "MODEL_NAME",
    "NUM_BLOCKS",
    "QWEN3_TINY",
    "START_TIMEOUT_S",
    "VLLM_VERSION",
    "VllmEngine",
    "free_ports",
    "install_vllm",
    "reset_prefix_caches",
    "start_engines",
    "write_model",
]
