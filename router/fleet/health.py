"""Active health probes, and what the router learns from the workers on the way.

Every ``health.interval_s`` each worker's ``/health`` is probed; a worker that fails is
out of rotation until a probe passes. A healthy worker's ``/v1/models`` tells which models
it serves, and, when no capacity is configured for it, its ``/metrics`` tells its KV
capacity (vLLM's ``cache_config_info`` num_gpu_blocks x block_size, or SGLang's
``max_total_num_tokens``) so the residency model matches the real engine.

Each worker is probed and scraped on its own: whatever goes wrong with one (a refused
connection, a body that is not UTF-8, an answer nobody expected) is logged and counted
against that worker alone, and the rounds go on for the rest of the fleet. A probe that
times out while the router's own event loop stalled for half the timeout or more
(``loop_metrics.LoopLag``) is held against nobody: the answer may have waited unread
while the loop was busy, and an overloaded router would otherwise take every worker out
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import aiohttp
import orjson

from router.clock import monotonic
from router.config import HealthConfig
from router.errors import failure_text
from router.fleet.workers import Fleet, Worker
from router.index.engine_blocks import block_size_advice, divides
from router.index.residency import PrefixIndex
from router.observability.loop_metrics import LoopLag
from router.observability.sparse_log import SparseLog

log = logging.getLogger(__name__)

NO_HEADERS: Mapping[str, str] = MappingProxyType({})
# A probe's or scrape's body past this is refused: a worker must not be able to fill the
# router's memory. vLLM's /metrics is tens of KB, with many LoRA adapters a few MB.
MAX_PROBE_BODY_BYTES = 16 * 1024 * 1024
# A worker's KV capacity past this is capped: the index is sized by it, so a worker must
# not claim the router's memory either. Far past any engine (a B200 node keeps a few
# million tokens of a large model; a data-parallel worker of a small one, tens of millions).
MAX_CLAIMED_KV_TOKENS = 1 << 28

# Re-read each worker's model list every this many probes.
MODELS_EVERY = 12
# What a worker's network and answers are expected to throw; anything else is logged with
# its traceback, and is still that worker's failure alone.
EXPECTED_ERRORS = (aiohttp.ClientError, TimeoutError, ConnectionError, ValueError)


# vLLM's and SGLang's names for the load an engine reports.
_LOAD_NAMES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
}


# vLLM's counters of prompt tokens found in an offload tier (with their "_total" suffix,
# as exposed); by source where the engine splits them, else all its connector's hits.
_CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
_CONNECTOR_HITS = "vllm:external_prefix_cache_hits_total"
_OFFLOAD_HIT_NAMES = (_CACHED_BY_SOURCE, _CONNECTOR_HITS)
_OFFLOAD_SOURCES = frozenset({"host", "disk"})


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What an engine's /metrics says about it."""

    capacity_tokens: int | None = None
    started_at: float | None = None  # process_start_time_seconds
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # 0..1
    block_tokens: int | None = None  # tokens per KV block (vLLM's cache_config_info)
    # Prompt tokens read from an offload tier (vLLM's prompt_tokens_cached_by_source
    # host and disk; else its external_prefix_cache_hits), since the engine started.
    offload_hits: float | None = None


_WANTED = frozenset(
    {
        *_LOAD_NAMES,
        "vllm:cache_config_info",
        "sglang:max_total_num_tokens",
        "process_start_time_seconds",
        *_OFFLOAD_HIT_NAMES,
    }
)
_ESCAPE = re.compile(r"\\(.)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def wanted_samples(text: str, names: frozenset[str]) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of the samples named in ``names``, from Prometheus text.

    A scan rather than a full parse: an engine's /metrics is mostly histogram buckets
    the router never reads, and prometheus_client's parser spent most of the router's
    CPU on them. Lines it cannot read are skipped.
    """
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        cut = len(line)
        for separator in ("{", " "):
            found = line.find(separator)
            if 0 <= found < cut:
                cut = found
        name, rest = line[:cut], line[cut:]
        if name not in names:
            continue
        labels: dict[str, str] = {}
        if rest.startswith("{"):
            close = rest.rfind("}")
            if close < 0:
                continue
            labels = {k: _ESCAPE.sub(_unescape, v) for k, v in _LABEL.findall(rest[1:close])}
            rest = rest[close + 1 :]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        yield name, labels, value


def _unescape(match: re.Match[str]) -> str:
    return "\n" if match.group(1) == "n" else match.group(1)


def read_engine_metrics(text: str) -> EngineFacts:
    """KV capacity (vLLM's ``cache_config_info`` num_gpu_blocks x block_size, or SGLang's
    ``max_total_num_tokens``) and process start time from an engine's /metrics text."""
    capacity: int | None = None
    block: int | None = None
    started: float | None = None
    load: dict[str, float] = {}
    offload: dict[str, float] = {}
    for name, labels, value in wanted_samples(text, _WANTED):
        if not math.isfinite(value):  # NaN and Inf are valid Prometheus, not a count
            continue
        if name in _OFFLOAD_HIT_NAMES:
            if name == _CONNECTOR_HITS or labels.get("source") in _OFFLOAD_SOURCES:
                offload[name] = offload.get(name, 0.0) + max(0.0, value)
            continue
        key = _LOAD_NAMES.get(name)
        if key is not None:
            load[key] = load.get(key, 0.0) + value  # summed over engines
            continue
        if name == "vllm:cache_config_info" and capacity is None:
            with contextlib.suppress(KeyError, ValueError):
                block = int(labels["block_size"])
                capacity = int(labels["num_gpu_blocks"]) * block
            if capacity is not None and capacity <= 0:
                capacity = None
            if block is not None and block <= 0:
                block = None
        elif name == "sglang:max_total_num_tokens" and value > 0:
            capacity = int(value)
        elif name == "process_start_time_seconds":
            started = value
    running, waiting = load.get("running"), load.get("waiting")
    return EngineFacts(
        capacity,
        started,
        None if running is None else int(running),
        None if waiting is None else int(waiting),
        load.get("kv_usage"),
        block,
        offload.get(_CACHED_BY_SOURCE, offload.get(_CONNECTOR_HITS)),
    )


class HealthProber:
    def __init__(
        self,
        fleet: Fleet,
        index: PrefixIndex,
        session: aiohttp.ClientSession,
        config: HealthConfig,
        block_tokens: int,
        discover_capacity: set[str],
        on_restart: Callable[[Worker], None],
        headers: Mapping[str, str] = NO_HEADERS,
        keys_by_tokens: bool = False,
        refused: Callable[[str, str], None] = lambda worker, what: None,
    ) -> None:
        self._headers = headers  # the engines' api key, if any
        self._refused = refused  # (worker, what) of a read that gave nothing usable
        self._sparse = SparseLog(log)  # restarts: an engine may claim one every scrape
        # Prompts keyed by the engines' tokens: the router's blocks must be theirs.
        self._keys_by_tokens = keys_by_tokens
        self._told_block_size: set[str] = set()  # workers whose wrong block size is logged
        self._fleet = fleet
        self._on_restart = on_restart
        self._index = index
        self._session = session
        self._config = config
        self._block_tokens = block_tokens
        self._discover = set(discover_capacity)
        self._round = 0
        self.lag = LoopLag()  # watched while the rounds run

    def discover_capacity(self, worker: str) -> None:
        """Read this worker's KV capacity from its /metrics (a worker added at runtime)."""
        self._discover.add(worker)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(w) for w in self._fleet.all()))
        self._round += 1

    async def run(self) -> None:
        self.lag.start()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._every(self._config.interval_s, self.probe_all))
                group.create_task(self._every(self._config.scrape_interval_s, self.scrape_all))
        finally:
            self.lag.stop()

    @staticmethod
    async def _every(seconds: float, action: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(seconds)
            await action()

    async def scrape_all(self) -> None:
        """Every healthy worker's /metrics: load, restarts, capacity."""
        await asyncio.gather(*(self._scrape(w) for w in self._fleet.all() if w.healthy))

    async def _scrape(self, worker: Worker) -> None:
        await self._isolated(worker, "metrics", self._read_metrics)

    async def refresh(self, worker: Worker) -> None:
        """Read ``worker``'s /metrics now (a restart it shows is acted on now)."""
        await self._scrape(worker)

    async def _get(self, url: str) -> tuple[int, bytes]:
        """Status and body; the body as bytes, since a worker's encoding is not ours to trust."""
        timeout = aiohttp.ClientTimeout(total=self._config.timeout_s)
        async with self._session.get(url, timeout=timeout, headers=self._headers) as response:
            body = bytearray()
            async for chunk in response.content.iter_any():
                body += chunk
                if len(body) > MAX_PROBE_BODY_BYTES:
                    raise ValueError(f"{url} answered more than {MAX_PROBE_BODY_BYTES} bytes")
            return response.status, bytes(body)

    async def _probe(self, worker: Worker) -> None:
        started = asyncio.get_running_loop().time()
        try:
            status, _ = await self._get(worker.url + "/health")
        except Exception as exc:  # any failure of one worker's probe is that worker's alone
            stalled = self.lag.worst_since(started)
            if isinstance(exc, TimeoutError) and stalled >= self._config.timeout_s / 2:
                # The router's own loop was too busy to read the answer in time: an
                # overloaded router would otherwise take every worker out at once.
                log.warning(
                    "health probe of %s timed out while the router's event loop stalled "
                    "%.2f s: not held against the worker",
                    worker.name,
                    stalled,
                )
                return
            _log_unexpected("health probe", worker, exc)
            self._set_health(worker, False, failure_text(exc))
            return
        self._set_health(worker, status == 200, f"status {status}")
        if status == 200:
            await self._learn(worker)

    async def _learn(self, worker: Worker) -> None:
        """A healthy worker's models, and its metrics until they have been read once."""
        if not worker.models or self._round % MODELS_EVERY == 0:
            await self._isolated(worker, "models", self._learn_models)
        if worker.metrics_at is None:
            await self._isolated(worker, "metrics", self._read_metrics)

    async def _isolated(
        self, worker: Worker, what: str, action: Callable[[Worker], Awaitable[None]]
    ) -> None:
        """``action(worker)``; a failure leaves what it would have learnt unknown (stale
        metrics count as saturated), is counted, and never reaches the other workers'
        probes."""
        try:
            await action(worker)
        except Exception as exc:  # one worker's surprise must not end the fleet's rounds
            self._refused(worker.name, what)
            _log_unexpected(what, worker, exc)

    def _set_health(self, worker: Worker, healthy: bool, why: str) -> None:
        if healthy != worker.healthy:
            log.warning(
                "worker %s is %s (%s)", worker.name, "healthy" if healthy else "unhealthy", why
            )
        worker.healthy = healthy
        if not healthy:
            worker.abandon_unanswered()

    async def _learn_models(self, worker: Worker) -> None:
        status, raw = await self._get(worker.url + "/v1/models")
        if status != 200:
            self._refused(worker.name, "models")
            return
        body = orjson.loads(raw)
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            self._refused(worker.name, "models")
            return
        cards = [m for m in data if isinstance(m, dict) and "id" in m]
        self._fleet.set_models(worker, frozenset(str(m["id"]) for m in cards))
        # vLLM lists LoRA adapters with their base model as "parent".
        worker.base_model = next((str(m["id"]) for m in cards if m.get("parent") is None), None)

    async def _read_metrics(self, worker: Worker) -> None:
        status, raw = await self._get(worker.url + "/metrics")
        if status != 200:
            self._refused(worker.name, "metrics")
            return
        facts = read_engine_metrics(raw.decode("utf-8", errors="replace"))
        if facts.running is not None or facts.waiting is not None:
            worker.engine_running = facts.running or 0
            worker.engine_waiting = facts.waiting or 0
            worker.engine_kv_usage = facts.kv_usage or 0.0
            worker.metrics_at = monotonic()
        if facts.offload_hits is not None:
            worker.engine_offload_hits = facts.offload_hits
        if facts.block_tokens is not None:
            worker.engine_block_tokens = facts.block_tokens
            self._check_block_size(worker, facts.block_tokens)
        if worker.name in self._discover and facts.capacity_tokens:
            capacity = facts.capacity_tokens
            if capacity > MAX_CLAIMED_KV_TOKENS:
                self._refused(worker.name, "capacity")
                log.warning(
                    "worker %s claims %d KV tokens; taken as %d",
                    worker.name,
                    capacity,
                    MAX_CLAIMED_KV_TOKENS,
                )
                capacity = MAX_CLAIMED_KV_TOKENS
            worker.capacity_tokens = capacity
            self._index.resize_worker(worker.name, max(1, capacity // self._block_tokens))
            self._discover.discard(worker.name)
            log.info("worker %s reports %d KV tokens", worker.name, capacity)
        if facts.started_at is not None:
            restarted = worker.engine_started_at not in (None, facts.started_at)
            worker.engine_started_at = facts.started_at
            if restarted:
                self._sparse.warning(
                    worker.name,
                    "worker %s restarted; its cache is gone, purging its entries",
                    worker.name,
                )
                self._on_restart(worker)

    def _check_block_size(self, worker: Worker, engine_block: int) -> None:
        """In token mode an engine block that is not a run of whole router blocks
        leaves the router's predictions short by up to a router block: said once a
        worker. (Text mode's blocks are estimates: nothing to line up.)"""
        if (
            not self._keys_by_tokens
            or divides(self._block_tokens, engine_block)
            or worker.name in self._told_block_size
        ):
            return
        self._told_block_size.add(worker.name)
        log.warning(
            "worker %s: %s; its predictions fall short by up to a block",
            worker.name,
            block_size_advice(engine_block, self._block_tokens),
        )


def _log_unexpected(what: str, worker: Worker, exc: Exception) -> None:
    """Expected failures show in the health transitions; a surprise gets its traceback."""
    if isinstance(exc, EXPECTED_ERRORS):
        log.debug("%s of worker %s failed: %s", what, worker.name, failure_text(exc))
    else:
        log.warning("%s of worker %s failed: %r", what, worker.name, exc, exc_info=exc)
