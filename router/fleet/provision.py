"""Workers built from their configuration: capacity and circuit breaker."""

from __future__ import annotations

from router.config import DEFAULT_KV_TOKENS, RouterConfig, WorkerConfig
from router.errors import RouterError
from router.fleet.breaker import CircuitBreaker
from router.fleet.workers import Worker
from router.planning.capacity import CapacityError, dtype_bytes, gpu, load_model, plan


def worker_capacity(config: RouterConfig, configured: int | None) -> int | None:
    """A worker's KV capacity from config, or None to discover it from the engine."""
    if configured is not None:
        return configured
    cap = config.capacity
    if cap.kv_tokens is not None:
        return cap.kv_tokens
    if cap.model and cap.gpu:
        try:
            kv_bytes = dtype_bytes(cap.kv_dtype) if cap.kv_dtype else None
            return plan(
                load_model(cap.model),
                gpu(cap.gpu),
                cap.gpus_per_worker,
                cap.gpu_memory_utilization,
                kv_bytes,
            ).resident_tokens
        except CapacityError as exc:
            raise RouterError(f"capacity: {exc}") from exc
    return None


def new_worker(config: RouterConfig, wc: WorkerConfig) -> tuple[Worker, bool]:
    """A worker from its config; False when its capacity must be read from the engine."""
    capacity = worker_capacity(config, wc.kv_tokens)
    health = config.health
    breaker = CircuitBreaker(health.failure_threshold, health.cooldown_s, health.max_cooldown_s)
    worker = Worker(
        wc.name,
        wc.url.rstrip("/"),
        capacity or DEFAULT_KV_TOKENS,
        breaker=breaker,
        kv_events=wc.kv_events,
        offload_tokens=wc.offload_tokens
        if wc.offload_tokens is not None
        else config.offload.tier_tokens,
    )
    return worker, capacity is not None
