"""Active health probes, and what the router learns from the workers on the way.

Every ``health.interval_s`` each worker's ``/health`` is probed; a worker that fails is
out of rotation until a probe passes. A healthy worker's ``/v1/models`` tells which models
it serves, and, when no capacity is configured for it, its ``/metrics`` tells its KV
capacity (vLLM's ``cache_config_info`` num_gpu_blocks x block_size, or SGLang's
``max_total_num_tokens``) so the residency model matches the real engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from router.config import HealthConfig
from router.index import PrefixIndex
from router.workers import Fleet, Worker

log = logging.getLogger(__name__)

# Re-read each worker's model list every this many probes.
MODELS_EVERY = 12


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What an engine's /metrics says about it."""

    capacity_tokens: int | None = None
    started_at: float | None = None  # process_start_time_seconds


def read_engine_metrics(text: str) -> EngineFacts:
    """KV capacity (vLLM's ``cache_config_info`` num_gpu_blocks x block_size, or SGLang's
    ``max_total_num_tokens``) and process start time from an engine's /metrics text."""
    capacity: int | None = None
    started: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info" and capacity is None:
                with contextlib.suppress(KeyError, ValueError):
                    capacity = (int(sample.labels["num_gpu_blocks"])
                                * int(sample.labels["block_size"]))
            elif sample.name == "sglang:max_total_num_tokens" and sample.value > 0:
                capacity = int(sample.value)
            elif sample.name == "process_start_time_seconds":
                started = sample.value
    return EngineFacts(capacity, started)


class HealthProber:
    def __init__(self, fleet: Fleet, index: PrefixIndex, session: aiohttp.ClientSession,
                 config: HealthConfig, block_tokens: int, discover_capacity: set[str],
                 on_restart: Callable[[Worker], None]) -> None:
        self._fleet = fleet
        self._on_restart = on_restart
        self._index = index
        self._session = session
        self._config = config
        self._block_tokens = block_tokens
        self._discover = set(discover_capacity)
        self._round = 0

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(w) for w in self._fleet.all()))
        self._round += 1

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._config.interval_s)
            await self.probe_all()

    async def _get(self, url: str) -> tuple[int, str]:
        timeout = aiohttp.ClientTimeout(total=self._config.timeout_s)
        async with self._session.get(url, timeout=timeout) as response:
            return response.status, await response.text()

    async def _probe(self, worker: Worker) -> None:
        try:
            status, _ = await self._get(worker.url + "/health")
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            self._set_health(worker, False, repr(exc))
            return
        self._set_health(worker, status == 200, f"status {status}")
        if status != 200:
            return
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ConnectionError, ValueError):
            if not worker.models or self._round % MODELS_EVERY == 0:
                await self._learn_models(worker)
            await self._read_metrics(worker)

    def _set_health(self, worker: Worker, healthy: bool, why: str) -> None:
        if healthy != worker.healthy:
            log.warning("worker %s is %s (%s)", worker.name,
                        "healthy" if healthy else "unhealthy", why)
        worker.healthy = healthy

    async def _learn_models(self, worker: Worker) -> None:
        status, text = await self._get(worker.url + "/v1/models")
        if status == 200:
            body = orjson.loads(text)
            data = body.get("data") if isinstance(body, dict) else None
            if isinstance(data, list):
                worker.models = frozenset(str(m["id"]) for m in data
                                          if isinstance(m, dict) and "id" in m)

    async def _read_metrics(self, worker: Worker) -> None:
        status, text = await self._get(worker.url + "/metrics")
        if status != 200:
            return
        facts = read_engine_metrics(text)
        if worker.name in self._discover and facts.capacity_tokens:
            worker.capacity_tokens = facts.capacity_tokens
            self._index.resize_worker(worker.name,
                                      max(1, facts.capacity_tokens // self._block_tokens))
            self._discover.discard(worker.name)
            log.info("worker %s reports %d KV tokens", worker.name, facts.capacity_tokens)
        if facts.started_at is not None:
            if worker.engine_started_at not in (None, facts.started_at):
                log.warning("worker %s restarted; its cache is gone, purging its entries",
                            worker.name)
                self._on_restart(worker)
            worker.engine_started_at = facts.started_at
