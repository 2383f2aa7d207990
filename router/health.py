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

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from router.config import HealthConfig
from router.index import PrefixIndex
from router.workers import Fleet, Worker

log = logging.getLogger(__name__)

# Re-read each worker's model list every this many probes.
MODELS_EVERY = 12


def capacity_from_metrics(text: str) -> int | None:
    """KV capacity in tokens from an engine's /metrics text, if it says."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                try:
                    blocks = int(sample.labels["num_gpu_blocks"])
                    return blocks * int(sample.labels["block_size"])
                except (KeyError, ValueError):
                    continue
            if sample.name == "sglang:max_total_num_tokens" and sample.value > 0:
                return int(sample.value)
    return None


class HealthProber:
    def __init__(self, fleet: Fleet, index: PrefixIndex, session: aiohttp.ClientSession,
                 config: HealthConfig, block_tokens: int, discover_capacity: set[str]) -> None:
        self._fleet = fleet
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
            if worker.name in self._discover:
                await self._learn_capacity(worker)

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

    async def _learn_capacity(self, worker: Worker) -> None:
        status, text = await self._get(worker.url + "/metrics")
        tokens = capacity_from_metrics(text) if status == 200 else None
        if tokens:
            worker.capacity_tokens = tokens
            self._index.resize_worker(worker.name, max(1, tokens // self._block_tokens))
            self._discover.discard(worker.name)
            log.info("worker %s reports %d KV tokens", worker.name, tokens)
