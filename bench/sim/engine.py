"""The simulated engine: a scheduler loop paced by a roofline on a scaled clock."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import math
import operator
import os
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import xxhash

from bench.sim import checkpoint as checkpoints
from bench.sim.config import EngineConfig
from bench.sim.faults import Faults
from bench.sim.kv_cache import BlockPool
from bench.sim.kv_event_log import EngineEvents, EventLog
from bench.sim.kv_stream import KVEventStream
from bench.sim.metrics import EngineMetrics
from bench.sim.model_prompts import ModelPrompts
from bench.sim.offload import OffloadTier
from bench.sim.prefix_hashes import PrefixHashes
from bench.sim.prompts import STAND_IN, Prompts
from bench.sim.request import SimRequest
from bench.sim.request_log import RequestLog, RequestRecord
from bench.sim.responses_store import ResponseStore
from bench.sim.roofline import Roofline
from bench.sim.scheduler import Scheduler, StepOutcome, StepPlan
from bench.sim.sglang_kv_event_log import SglangEngineEvents
from bench.sim.sglang_kv_events import SglangKVEventsConfig
from bench.sim.vllm_hash import BlockHasher
from bench.sim.windows import WindowGroups
from router.clock import monotonic
from router.planning.capacity import plan as capacity_plan

log = logging.getLogger(__name__)

# Reply length when a request does not ask for an exact one (no ignore_eos): lognormal.
NATURAL_REPLY_MEDIAN_TOKENS = 200
NATURAL_REPLY_SIGMA = 0.8
# Most decode steps one span may cover (bounds the precomputed step ends).
MAX_DECODE_SPAN = 4096
# The loop may run this far (wall-clock seconds) behind simulated time and catch up
# without stretching it; further behind, the lost time is taken as simulated time.
MAX_CATCH_UP_WALL_S = 0.1
# A step ending closer than this (wall-clock seconds) to now has ended: event loops'
# clocks are no finer (looptime's virtual clock counts microseconds), and waiting
# for the remainder would spin.
CLOCK_RESOLUTION_S = 1e-6


class SimClock:
    """Simulated seconds since start: wall-clock time multiplied by ``scale``."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self._origin = monotonic()

    def now(self) -> float:
        return (monotonic() - self._origin) * self.scale

    async def sleep_until(self, sim_time: float) -> None:
        delay = (sim_time - self.now()) / self.scale
        if delay > 0:
            await asyncio.sleep(delay)


def kv_capacity_tokens(config: EngineConfig) -> int:
    if config.kv_tokens is not None:
        return config.kv_tokens
    plan = capacity_plan(
        config.model,
        config.gpu,
        config.tensor_parallel_size,
        config.gpu_memory_utilization,
        config.kv_cache_dtype_bytes,
    )
    return plan.resident_tokens


def offload_tier(config: EngineConfig) -> OffloadTier | None:
    """The CPU tier ``config.kv_offloading_bytes`` buys, in the GPU's blocks."""
    if config.kv_offloading_bytes is None:
        return None
    block_bytes = config.block_tokens * config.model.kv_bytes_per_token(config.kv_cache_dtype_bytes)
    blocks = config.kv_offloading_bytes // block_bytes
    if blocks < 1:
        raise ValueError("kv_offloading_bytes holds less than one block")
    return OffloadTier(blocks)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.block_tokens = config.block_tokens
        self.num_blocks = kv_capacity_tokens(config) // config.block_tokens
        if self.num_blocks < 1:
            raise ValueError("the model's weights leave no memory for the KV cache")
        self.max_model_len = min(
            config.max_model_len or config.model.max_position_embeddings,
            self.num_blocks * config.block_tokens,
        )
        self.roofline = Roofline.for_engine(config)
        self.clock = SimClock(config.time_scale)
        self.faults = Faults()
        self.start_time = time.time()
        self.metrics = EngineMetrics(
            config.flavor,
            config.served_model_name,
            config.engine_id,
            self.cache_config_labels(),
            self.start_time,
            max_model_len=self.max_model_len,
            tool_call_parser=config.tool_call_parser is not None,
        )
        self.pool = BlockPool(self.num_blocks, config.block_tokens)
        self.prefix_hashes = PrefixHashes(config.block_tokens)
        self.offload = offload_tier(config)
        windows = None
        if config.sliding_window is not None:
            windows = WindowGroups(config.sliding_window, config.window_groups, self.block_tokens)
        self.scheduler = Scheduler(
            self.pool,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.offload,
            self.roofline.load_seconds(config.block_tokens, config.kv_offloading_gbps),
            windows,
        )
        # How prompts become tokens: the stand-in's, or the model's (``running_engine``).
        self.prompts: Prompts = STAND_IN
        self.kv_stream: KVEventStream | None = None
        # Each request's cached prefix at arrival and when scheduled (``GET /sim/requests``).
        self.requests = RequestLog()
        # Stored /v1/responses answers (used only with config.responses_store).
        self.responses = ResponseStore(config.responses_store_max)
        self._rng = random.Random(config.seed)
        self._wake = asyncio.Event()
        self._counter = 0
        # Prompt tokens looked up in the prefix cache and found there, since start.
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Earliest simulated time a request arrived or left since the last schedule.
        self._changed_at = math.inf
        # Where the last step ended, in simulated time.
        self._cursor = 0.0

    def cache_config_labels(self) -> dict[str, str]:
        """vLLM's CacheConfig fields as ``vllm:cache_config_info`` labels (``str()`` of each)."""
        config = self.config
        if config.flavor == "sglang":
            return {"max_total_num_tokens": str(self.num_blocks * config.block_tokens)}
        return {
            "block_size": str(config.block_tokens),
            "cache_dtype": "fp8" if config.kv_cache_dtype_bytes == 1 else "auto",
            "enable_prefix_caching": "True",
            "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "is_attention_free": "False",
            "kv_cache_memory_bytes": "None",
            "kv_sharing_fast_prefill": "False",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(self.num_blocks),
            "num_gpu_blocks_override": "None" if config.kv_tokens is None else str(self.num_blocks),
            "prefix_caching_hash_algo": config.prefix_caching_hash_algo,
            "sliding_window": "None",
        }

    # -- checkpoints (bench/sim/checkpoint.py) ----------------------------------------

    @property
    def requests_submitted(self) -> int:
        return self._counter

    def rng_state(self) -> tuple[Any, ...]:
        """The state of the generator that seeds unseeded requests."""
        return self._rng.getstate()

    def restore_counters(
        self, prefix_queries: int, prefix_hits: int, submitted: int, rng_state: Any
    ) -> None:
        """Continue a checkpoint's counters: the prefix-cache totals (in /metrics too),
        the request ids and the reply-length draws."""
        self.prefix_queries, self.prefix_hits = prefix_queries, prefix_hits
        if prefix_queries:
            self.metrics.record_prefix_query(prefix_queries, prefix_hits)
        self._counter = submitted
        if rng_state is not None:
            self._rng.setstate(rng_state)
        self.record_gauges()

    # -- requests ---------------------------------------------------------------------

    def submit(
        self,
        prompt: bytes,
        max_tokens: int,
        exact_length: bool,
        seed: int | None = None,
        cache_salt: str | None = None,
        request_id: str | None = None,
    ) -> SimRequest:
        """Queue a request; it generates ``max_tokens`` tokens when ``exact_length``,
        else a natural (lognormal) length capped at ``max_tokens``. ``request_id`` is
        the client's ``X-Request-Id``, kept in the request's record."""
        self._counter += 1
        rng = random.Random(seed if seed is not None else self._rng.getrandbits(64))
        length, reason = max_tokens, "length"
        if not exact_length:
            natural = max(
                1,
                int(rng.lognormvariate(math.log(NATURAL_REPLY_MEDIAN_TOKENS), NATURAL_REPLY_SIGMA)),
            )
            if natural < max_tokens:
                length, reason = natural, "stop"
        parent = xxhash.xxh3_64_intdigest(cache_salt.encode()) if cache_salt else 0
        request = SimRequest(
            f"{self.config.engine_id}-{self._counter}",
            prompt,
            length,
            self.clock.now(),
            self.block_tokens,
            rng,
            parent,
            reason,
            self.prefix_hashes.hashes(prompt, parent),
            cache_salt,
            self.prompts.reply_words,
        )
        request.max_tokens = max_tokens
        request.record = RequestRecord(
            request_id,
            request.prompt_tokens,
            self.scheduler.cached_tokens(request),
            request.arrival,
        )
        self.requests.add(request.record)
        self.scheduler.add(request)
        self._changed(request.arrival)
        return request

    def abort(self, request: SimRequest) -> None:
        if not request.finished:
            now = self.clock.now()
            self.scheduler.abort(request)
            self._record_finished(request, now)
            self._changed(now)

    def _changed(self, at: float) -> None:
        self._changed_at = min(self._changed_at, at)
        self._wake.set()

    async def restart(self) -> list[SimRequest]:
        """Lose every request in flight and the whole cache, as a process restart does;
        KV events start again from a new publisher (sequence 0, nothing to replay)."""
        dropped = self.scheduler.reset()
        self.requests.clear()  # a new process knows none of the old one's requests
        self.responses.clear()  # nor its stored responses (vLLM keeps them in memory)
        self.start_time = time.time()
        self.metrics.reset(self.start_time)
        self.prefix_queries = self.prefix_hits = 0
        for request in dropped:
            request.updated.set()
        self._changed(self.clock.now())
        log.info("simulated restart: dropped %d requests, cache emptied", len(dropped))
        if self.kv_stream is not None:
            # The new process knows none of the old one's blocks; what it caches while
            # the publisher is swapped goes out from the new one.
            self.publish_kv_events(self.kv_stream)
            await self.kv_stream.restart()
        return dropped

    def reset_prefix_cache(self, reset_running: bool = False) -> bool:
        """vLLM's ``reset_prefix_cache``: forget every cached block (``AllBlocksCleared``
        with the next step's events) if no request holds one; with ``reset_running``,
        running requests are preempted first (they compute their prompts again)."""
        done, preempted = self.scheduler.reset_prefix_cache(reset_running)
        for _ in preempted:
            self.metrics.record_preemption()
        if preempted:
            self._changed(self.clock.now())
        if not done:
            log.warning("prefix cache not reset: requests still hold blocks")
        return done

    def publish_kv_events(self, stream: KVEventStream) -> None:
        """Announce the pool's changes on ``stream``, from a clean slate, in the events
        of the engine's flavour."""
        config = self.config
        self.kv_stream = stream
        log: EventLog
        if isinstance(config.kv_events, SglangKVEventsConfig):
            log = SglangEngineEvents(stream, config.block_tokens, config.kv_events.format)
        else:
            hasher = BlockHasher(config.prefix_caching_hash_algo)
            int_hashes = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"
            log = EngineEvents(
                stream,
                hasher,
                config.block_tokens,
                int_hashes,
                config.kv_offloading_self_describing_events,
                None
                if config.sliding_window is None
                else (config.sliding_window, config.window_groups),
            )
        self.scheduler.publish_kv_events(log)

    # -- the loop ---------------------------------------------------------------------

    async def run(self) -> None:
        """Schedule, then sleep until the step (or decode span) ends, then apply it.

        Steps run back to back in simulated time: a step starts where the previous one
        ended, not when the loop got round to it, so the loop's own Python time does
        not stretch simulated time unless it falls behind by more than
        ``MAX_CATCH_UP_WALL_S``. A decode span stops early at the first step boundary
        after a request arrives or leaves, so the batch changes exactly when it would
        have step by step.
        """
        scheduler = self.scheduler
        while True:
            await self.faults.wait_unstalled()
            if not scheduler.has_work:
                if scheduler.events is not None:
                    scheduler.events.idle()
                self._wake.clear()
                self._changed_at = math.inf
                await self._wake.wait()
                self._cursor = self.clock.now()
                continue
            self._changed_at = math.inf
            now = self.clock.now()
            start = max(self._cursor, now - MAX_CATCH_UP_WALL_S * self.clock.scale)
            plan = scheduler.schedule(start)
            for queried, hit in plan.prefix_queries:
                self.metrics.record_prefix_query(queried, hit)
                self.prefix_queries += queried
                self.prefix_hits += hit
            for queried, hit in plan.offload_queries:
                self.metrics.record_offload_query(queried, hit)
            for _ in plan.preempted:
                self.metrics.record_preemption()
            load_end = scheduler.next_load_end()
            if load_end is not None:  # a span ends at the step where it does
                self._changed_at = min(self._changed_at, load_end)
            if not plan.work:
                # Nothing fits this instant (every block pinned, or the prompts are
                # loading from the offload tier); wait for a change or a load's end.
                # A step that only started loads evicted for them: vLLM publishes it.
                if plan.offload_queries and scheduler.events is not None:
                    scheduler.events.flush()
                timeout = 0.01 if load_end is None else (load_end - now) / self.clock.scale
                await self._wait_for_change(max(timeout, CLOCK_RESOLUTION_S))
                self._cursor = self.clock.now()
                continue
            self._mark_scheduled(plan, start)
            span = scheduler.decode_span(plan, MAX_DECODE_SPAN)
            if span == 1:
                end = start + self.roofline.step_seconds(plan.shape())
                end += await self._sleep_until(end)
                self._publish(scheduler.complete(plan, end), end)
            else:
                end = await self._run_span(plan, start, span)
            self._cursor = end
            self.record_gauges()

    def _mark_scheduled(self, plan: StepPlan, start: float) -> None:
        """Time the requests ``plan`` runs for the first time, and record the cached
        prefix each was admitted with (the usage's ``cached_tokens``)."""
        for request, _, _ in plan.work:
            if request.scheduled_at is None:
                request.scheduled_at = at = max(start, request.arrival)
                if request.record is not None:
                    request.record.scheduled(request.cached_tokens, at, request.loaded_tokens)

    async def _run_span(self, plan: StepPlan, start: float, span: int) -> float:
        """Run up to ``span`` decode steps of ``plan``, publishing tokens at least every
        ``stream_flush_s``; returns the simulated time the last step run ended."""
        contexts = [context for _, _, context in plan.work]
        ends = list(
            itertools.accumulate(
                self.roofline.decode_step_seconds(len(contexts), sum(contexts), span), initial=start
            )
        )[1:]
        flush_s = self.config.stream_flush_wall_s * self.clock.scale
        done = 0
        while done < span:
            if self._changed_at < ends[span - 1]:
                # Something arrived or left: finish the step in progress, then reschedule.
                span = max(bisect.bisect_left(ends, self._changed_at) + 1, done + 1)
            target = ends[span - 1]
            if flush_s > 0:
                target = min(target, max(self.clock.now() + flush_s, ends[done]))
            else:
                target = ends[done]
            stalled = await self._sleep_until(target, wake=True)
            if stalled:
                ends[done:] = [e + stalled for e in ends[done:]]
            now = self.clock.now() + CLOCK_RESOLUTION_S * self.clock.scale
            reached = min(bisect.bisect_right(ends, now, lo=done), span)
            if reached > done:
                self._publish(
                    self.scheduler.complete_decode(plan, done, ends[done:reached]),
                    ends[reached - 1],
                    reached - done,
                )
                done = reached
        return ends[span - 1]

    async def _sleep_until(self, sim_time: float, wake: bool = False) -> float:
        """Sleep until ``sim_time`` (or, with ``wake``, until a request arrives or
        leaves), then wait out any stall; returns the simulated seconds it stalled."""
        delay = (sim_time - self.clock.now()) / self.clock.scale
        if delay > CLOCK_RESOLUTION_S:
            if wake:
                await self._wait_for_change(delay)
            else:
                await asyncio.sleep(delay)
        if not self.faults.state.stall:
            return 0.0
        stalled_at = self.clock.now()
        await self.faults.wait_unstalled()
        return self.clock.now() - stalled_at

    async def _wait_for_change(self, timeout_s: float) -> None:
        """Until a request arrives or leaves, or ``timeout_s`` (wall-clock) passes.
        The timeout is a timer that sets the wake-up event, not ``asyncio.timeout``:
        a decode span waits like this at every flush and mostly times out, and a
        timeout cancelled the task and raised through it each time."""
        self._wake.clear()
        timer = asyncio.get_running_loop().call_later(timeout_s, self._wake.set)
        try:
            await self._wake.wait()
        finally:
            timer.cancel()

    def record_gauges(self) -> None:
        self.metrics.record_step(
            len(self.scheduler.running), len(self.scheduler.waiting), self.pool.usage()
        )

    def _publish(self, outcome: StepOutcome, now: float, steps: int = 1) -> None:
        """Hand out what ``steps`` steps produced (more than one only in a decode span,
        where every step gives each request in ``outcome.advanced`` a token)."""
        interval = self.config.stream_interval
        if outcome.advanced:
            # vLLM's tokens per step: those sampled, plus each finished prefill's computed
            # (not cached) prompt tokens; a step that produced no token is not counted.
            prefilled = sum(r.prompt_tokens - r.cached_tokens for r in outcome.first_tokens)
            self.metrics.record_iteration(prefilled + len(outcome.advanced), steps)
        for request in outcome.first_tokens:
            self.metrics.record_first_token(now - request.arrival)
            if request.record is not None:
                request.record.first_token_at = now
        for request in outcome.finished:
            self._record_finished(request, now)
        for request in outcome.advanced:
            # Wake the handler on the first token, at the end, and whenever the output
            # crossed a multiple of the stream interval since the last publish.
            if (
                request.finished
                or request.published_tokens == 0
                or (request.output_tokens // interval > request.published_tokens // interval)
            ):
                request.published_tokens = request.output_tokens
                request.notify()

    def _record_finished(self, request: SimRequest, now: float) -> None:
        scheduled = request.scheduled_at if request.scheduled_at is not None else now
        first = request.first_token_at if request.first_token_at is not None else now
        times = request.token_times
        self.metrics.record_finished(
            finished_reason=request.finish_reason or "abort",
            prompt_tokens=request.prompt_tokens,
            generation_tokens=request.output_tokens,
            e2e_s=now - request.arrival,
            queue_s=scheduled - request.arrival,
            prefill_s=first - scheduled,
            decode_s=now - first,
            # The gaps between consecutive token times (``map`` of C ``sub``: a third
            # cheaper than a comprehension over ``pairwise``; the same floats).
            inter_token_s=list(map(operator.sub, times[1:], times)),
            cached_tokens=request.cached_tokens,
            num_preemptions=request.num_preemptions,
            max_tokens=request.max_tokens,
        )


@contextlib.asynccontextmanager
async def running_engine(config: EngineConfig) -> AsyncIterator[Engine]:
    """An engine with its loop running, its tokenizer loaded, its KV events published
    and its cache restored (``config.restore``, raising ``CheckpointError``) as
    ``config`` says; the loop is cancelled and the rest closed on exit."""
    engine = Engine(config)
    async with contextlib.AsyncExitStack() as stack:
        if config.tokenizer is not None:
            # Reading a real tokenizer takes a moment: not on the loop.
            prompts = await asyncio.to_thread(ModelPrompts.load, config.tokenizer)
            stack.callback(prompts.close)
            engine.prompts = prompts
        if config.kv_events is not None and config.kv_events.publishes:
            stream = KVEventStream(config.kv_events)
            stack.push_async_callback(stream.close)
            engine.publish_kv_events(stream)
        if config.restore is not None:
            checkpoint = await asyncio.to_thread(checkpoints.read, config.restore)
            checkpoints.apply(engine, checkpoint)
            log.info("restored %d cached blocks from %s", checkpoint.cached_blocks, config.restore)
        task = asyncio.create_task(engine.run(), name=f"sim-engine-{config.engine_id}")
        try:
            yield engine
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
