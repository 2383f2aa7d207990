"""How fast an engine reads a prefix back from its CPU tier, in tokens per second: the
host link's bytes per second over the KV bytes a token takes. The router prices a hit in
a CPU tier by it (``policies.base.WorkerView.reload_tokens_per_s``)."""

from __future__ import annotations

from router.config import CapacityConfig, OffloadConfig
from router.planning.capacity import GB, dtype_bytes, load_model
from router.planning.interruption import DEFAULT_RESTORE_GBPS


def kv_bytes_per_token(offload: OffloadConfig, capacity: CapacityConfig) -> int:
    """The engines' KV bytes per token: configured, else from the capacity's model (0:
    neither says)."""
    if offload.kv_bytes_per_token:
        return offload.kv_bytes_per_token
    if capacity.model is None:
        return 0
    kv_dtype = dtype_bytes(capacity.kv_dtype) if capacity.kv_dtype else None
    return load_model(capacity.model).kv_bytes_per_token(kv_dtype)


def reload_tokens_per_s(offload: OffloadConfig, capacity: CapacityConfig) -> float:
    """Tokens a second one worker reads back from its CPU tier (0: not known)."""
    per_token = kv_bytes_per_token(offload, capacity)
    if not per_token:
        return 0.0
    link = offload.link_gbps if offload.link_gbps is not None else DEFAULT_RESTORE_GBPS
    return link * GB * capacity.gpus_per_worker / per_token
