"""What a worker failure takes out of a fleet's KV budget, with and without a checkpoint.

A worker is one engine: ``num_gpus`` GPUs under tensor parallelism. When its cache is full
a failure loses all of it, ``resident_tokens`` of the capacity plan. Two ways back:

* **Re-prefill** the returning sessions from their transcripts. Prefill is compute-bound,
  so its rate comes from a roofline (the same one ``bench/sim/roofline.py`` uses)::

      FLOPs per token = 2 x active_parameters                     (the dense matmuls)
                      + 2 x layers x attention_width x context    (QK^T and AV: a causal
                                                                   prefill of C tokens has
                                                                   C^2 / 2 pairs at 4 x
                                                                   layers x width each)
      tokens / s      = num_gpus x peak dense BF16 FLOP/s x MFU / FLOPs per token

  ``context`` is the plan's session length: a cache full of C-token sessions is rebuilt
  as whole C-token prefills.
* **Restore a checkpoint** that captured the KV cache: nothing is re-prefilled, but the
  cache's bytes (``resident_tokens x bytes_per_token``) are read back, each GPU its own
  shard over its own host link. This is the KV part only; the weights reload too.

A hybrid model's cache holds fewer tokens of C-token sessions than ``resident_tokens``
(their windows and states take room too): its tokens at risk are ``resident_tokens_at(C)``
and its checkpoint their bytes. The FLOPs count every layer as attending to the whole
context, so a hybrid model's rebuild times are upper bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.planning.capacity import GB, CapacityError, CapacityPlan, GpuSpec, ModelShape

# Fraction of peak dense BF16 FLOP/s a long prefill sustains (model FLOPs utilisation);
# large prefills on H100-class GPUs reach 40-60%. The simulated engine prefills at it too.
DEFAULT_PREFILL_MFU = 0.5
# Host-to-GPU read rate per GPU for a restore: PCIe Gen5 x16 is 64 GB/s raw, ~50 GB/s
# effective. A restore from local NVMe or the network is slower; pass --restore-gbps.
DEFAULT_RESTORE_GBPS = 50.0


def prefill_flops_per_token(model: ModelShape, context_tokens: int) -> float:
    """Average FLOPs per token of prefilling ``context_tokens`` from nothing."""
    attention = 2.0 * model.num_layers * model.attention_width * context_tokens
    return 2.0 * model.active_parameters + attention


def prefill_tokens_per_second(
    model: ModelShape,
    gpu_spec: GpuSpec,
    num_gpus: int,
    context_tokens: int,
    mfu: float = DEFAULT_PREFILL_MFU,
) -> float:
    flops_per_second = gpu_spec.dense_bf16_flops * num_gpus * mfu
    return flops_per_second / prefill_flops_per_token(model, context_tokens)


@dataclass(frozen=True, slots=True)
class InterruptionCost:
    """One worker's failure in a fleet of ``workers`` identical ones, its cache full."""

    workers: int
    tokens_at_risk: int  # one worker's resident tokens
    checkpoint_bytes: int  # what those tokens take in the cache
    weight_bytes: int
    prefill_tokens_per_s: float  # one worker
    attention_share: float  # of the prefill FLOPs, at the plan's context
    restore_bytes_per_s: float  # one worker, all its GPUs' links

    @property
    def fleet_tokens(self) -> int:
        return self.workers * self.tokens_at_risk

    @property
    def share_of_fleet(self) -> float:
        return 1.0 / self.workers

    @property
    def rebuild_seconds(self) -> float:
        """Re-prefilling every lost token on one worker, the sessions all back at once."""
        return self.tokens_at_risk / self.prefill_tokens_per_s

    @property
    def fleet_rebuild_seconds(self) -> float | None:
        """The same work spread evenly over the survivors; None when there are none."""
        survivors = self.workers - 1
        return self.rebuild_seconds / survivors if survivors else None

    @property
    def restore_seconds(self) -> float:
        return self.checkpoint_bytes / self.restore_bytes_per_s

    @property
    def weights_reload_seconds(self) -> float:
        return self.weight_bytes / self.restore_bytes_per_s


def interruption(
    capacity: CapacityPlan,
    model: ModelShape,
    gpu_spec: GpuSpec,
    num_gpus: int,
    workers: int,
    context_tokens: int,
    mfu: float = DEFAULT_PREFILL_MFU,
    restore_gbps: float = DEFAULT_RESTORE_GBPS,
) -> InterruptionCost:
    """The cost of losing one worker planned as ``capacity`` (one worker's plan)."""
    if workers < 1:
        raise CapacityError("workers must be >= 1")
    if not 0 < mfu <= 1:
        raise CapacityError("prefill MFU must be in (0, 1]")
    if restore_gbps <= 0:
        raise CapacityError("restore bandwidth must be > 0")
    if context_tokens < 1:
        raise CapacityError("context must be >= 1 token")
    flops = prefill_flops_per_token(model, context_tokens)
    return InterruptionCost(
        workers=workers,
        tokens_at_risk=capacity.resident_tokens_at(context_tokens),
        checkpoint_bytes=capacity.resident_bytes_at(context_tokens),
        weight_bytes=capacity.weight_bytes,
        prefill_tokens_per_s=prefill_tokens_per_second(
            model, gpu_spec, num_gpus, context_tokens, mfu
        ),
        attention_share=1.0 - 2.0 * model.active_parameters / flops,
        restore_bytes_per_s=restore_gbps * GB * num_gpus,
    )
