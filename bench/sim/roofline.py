"""Step time from a roofline: the slower of compute and memory traffic, plus a fixed cost.

For one engine step that computes ``new`` tokens on top of ``context`` already-computed
tokens for each scheduled request:

* FLOPs = 2 x active_parameters x sum(new)                 (the dense matmuls)
        + 4 x layers x attention_width x sum(new x (context + new / 2))
                                                           (QK^T and AV over the causal context)
* bytes = weight_bytes + kv_bytes_per_token x sum(context + new)
                                                           (weights once, each request's KV)
* time  = step_overhead + max(FLOPs / (peak_flops x prefill_efficiency),
                              bytes / (hbm_bandwidth x decode_efficiency))

Large prefills land on the compute side, decode batches on the memory side, and mixed
(chunked-prefill) steps pay whichever dominates, as on a real GPU. Tensor parallelism
multiplies peak FLOP/s and bandwidth by the GPU count.

Default constants (see ``bench.sim.config``): prefill at 50% of peak dense BF16 FLOP/s,
decode at 70% of peak HBM bandwidth, 2 ms per step of scheduling and launch overhead.
With them Llama-3.1-8B on one H100 prefills ~30K tokens/s on short contexts and decodes
a small batch in ~12 ms a step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from bench.sim.config import EngineConfig


@dataclass(frozen=True, slots=True)
class Roofline:
    active_parameters: float
    weight_bytes: float
    kv_bytes_per_token: float
    attention_flops_per_pair: float  # per (new token, context token) pair
    flops_per_second: float
    bytes_per_second: float
    step_overhead_s: float
    gpus: int = 1

    @classmethod
    def for_engine(cls, config: EngineConfig) -> Roofline:
        model, gpu, tp = config.model, config.gpu, config.tensor_parallel_size
        return cls(
            active_parameters=model.active_parameters,
            weight_bytes=model.weight_bytes,
            kv_bytes_per_token=model.kv_bytes_per_token(config.kv_cache_dtype_bytes),
            attention_flops_per_pair=4.0 * model.num_layers * model.attention_width,
            flops_per_second=gpu.dense_bf16_flops * tp * config.prefill_efficiency,
            bytes_per_second=gpu.hbm_bandwidth * tp * config.decode_efficiency,
            step_overhead_s=config.step_overhead_s,
            gpus=tp,
        )

    def load_seconds(self, tokens: int, link_gbps: float) -> float:
        """Seconds to read ``tokens`` of KV back over a host link of ``link_gbps`` GB/s
        per GPU (each GPU reads its shard)."""
        return tokens * self.kv_bytes_per_token / (link_gbps * 1e9 * self.gpus)

    def step_seconds(self, work: Iterable[tuple[int, int]]) -> float:
        """Seconds for one step; ``work`` holds (new_tokens, context_tokens) per request."""
        tokens = 0
        pairs = 0.0
        kv_tokens = 0
        for new, context in work:
            tokens += new
            pairs += new * (context + new / 2)
            kv_tokens += context + new
        if tokens == 0:
            return 0.0
        flops = 2.0 * self.active_parameters * tokens + self.attention_flops_per_pair * pairs
        traffic = self.weight_bytes + self.kv_bytes_per_token * kv_tokens
        return self.step_overhead_s + max(
            flops / self.flops_per_second, traffic / self.bytes_per_second
        )

    def decode_step_seconds(self, batch: int, context_tokens: int, steps: int) -> list[float]:
        """Seconds of each of ``steps`` consecutive decode steps of ``batch`` requests
        holding ``context_tokens`` in all before the first: step ``j`` (from 0) is
        ``step_seconds`` of ``(1, context + j)`` per request."""
        flops_fixed = 2.0 * self.active_parameters * batch
        pair = self.attention_flops_per_pair
        flops_per_second, bytes_per_second = self.flops_per_second, self.bytes_per_second
        seconds: list[float] = []
        for j in range(steps):
            flops = flops_fixed + pair * (context_tokens + batch * (j + 0.5))
            traffic = self.weight_bytes + self.kv_bytes_per_token * (
                context_tokens + batch * (j + 1)
            )
            seconds.append(
                self.step_overhead_s + max(flops / flops_per_second, traffic / bytes_per_second)
            )
        return seconds
