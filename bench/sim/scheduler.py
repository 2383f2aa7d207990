"""Continuous batching as vLLM's V1 scheduler does it, on plain values (no clock, no I/O).

Each step has a token budget (``max_num_batched_tokens``) and a seat limit
(``max_num_seqs``). Running requests are served first: a decode takes one token, an
unfinished prefill takes the next chunk that fits (chunked prefill). When the pool has no
block for a running request, the newest running request is preempted: its blocks are
released (their cached contents stay hittable) and it goes back to the front of the
waiting queue. Waiting requests are then admitted first-come first-served, each starting
from the longest cached prefix of its tokens, while budget, seats and blocks last; no
waiting request is admitted in a step that preempted.

A batch of running requests that are all decoding stays the same batch from step to
step until one of them finishes, a block runs out, or a request arrives or leaves: the
engine then runs those steps as one span (``decode_span``, ``complete_decode``) instead
of one Python iteration per token. The result is the same, step by step, as
scheduling each step alone: ``tests/sim/test_sim_scheduler.py`` checks it.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

from bench.sim.kv_cache import BlockPool
from bench.sim.kv_event_log import EventLog
from bench.sim.offload import OffloadTier
from bench.sim.request import FINISHED, RUNNING, WAITING, SimRequest
from bench.sim.windows import WindowGroups


@dataclass(slots=True)
class StepPlan:
    """What one step computes: (request, new tokens, context before) per request."""

    work: list[tuple[SimRequest, int, int]] = field(default_factory=list)
    preempted: list[SimRequest] = field(default_factory=list)
    # Prefix-cache lookups made while admitting: (prompt tokens queried, tokens hit).
    prefix_queries: list[tuple[int, int]] = field(default_factory=list)
    # Offload-tier lookups: (prompt tokens queried beyond the GPU's hit, tokens loaded).
    offload_queries: list[tuple[int, int]] = field(default_factory=list)

    def shape(self) -> list[tuple[int, int]]:
        return [(new, context) for _, new, context in self.work]


@dataclass(slots=True)
class StepOutcome:
    """Requests that produced a token this step, and the ones among them that finished."""

    advanced: list[SimRequest] = field(default_factory=list)
    first_tokens: list[SimRequest] = field(default_factory=list)
    finished: list[SimRequest] = field(default_factory=list)


def _blocks_for(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        offload: OffloadTier | None = None,
        load_seconds_per_block: float = 0.0,
        windows: WindowGroups | None = None,
    ) -> None:
        self.pool = pool
        self.windows = windows  # a hybrid model's sliding-window groups
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.offload = offload
        self.load_seconds_per_block = load_seconds_per_block
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.events: EventLog | None = None
        if windows is not None:
            pool.on_evict = self._evicted

    def publish_kv_events(self, events: EventLog) -> None:
        self.events = events
        self.pool.on_evict = self._evicted if self.windows is not None else events.removed
        if self.offload is not None:
            self.offload.on_evict = events.offload_removed

    def _evicted(self, pool_key: int) -> None:
        """A cached block was evicted: a window group's, or the full-attention group's."""
        owner = self.windows.evicted(pool_key) if self.windows is not None else None
        if self.events is None:
            return
        if owner is None:
            self.events.removed(pool_key)
        else:
            self.events.window_removed(*owner)

    def _cache(self, request: SimRequest, first: int, full: int) -> None:
        """Register the blocks ``first .. full`` of ``request`` just filled (and, with
        an offload tier, store them there)."""
        pool, events = self.pool, self.events
        hashes = request.hashes[first:full]
        fresh = [not pool.is_cached(h) for h in hashes] if events is not None else []
        pool.register_blocks(request.blocks[first:full], hashes)
        if events is not None:
            events.stored(request, first, fresh)
        if self.offload is not None:
            offloaded = self.offload.store(hashes)
            if events is not None:
                events.offload_stored(request, first, offloaded)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_load_end(self) -> float | None:
        """When the first load from the offload tier in flight ends (None: none is)."""
        ends = [r.loading_until for r in self.waiting if r.loading_until is not None]
        return min(ends, default=None)

    def add(self, request: SimRequest) -> None:
        self.waiting.append(request)

    def abort(self, request: SimRequest) -> None:
        """Drop a request wherever it is (client gone) and free what it held."""
        if request.status is RUNNING:
            self.running.remove(request)
            self._free(request)
        elif request.status is WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
            self._free(request)  # a load in flight holds its blocks
        request.status = FINISHED
        request.finish_reason = request.finish_reason or "abort"

    def schedule(self, now: float = 0.0) -> StepPlan:
        """The step starting at ``now`` (simulated seconds: loads from the offload tier
        end in time)."""
        plan = StepPlan()
        budget = self._schedule_running(plan, self.max_num_batched_tokens)
        if not plan.preempted:
            self._schedule_waiting(plan, budget, now)
            if not plan.work and not self.running and self._give_back_loads(now):
                self._schedule_waiting(plan, budget, now)
        return plan

    def _give_back_loads(self, now: float) -> bool:
        """Nothing runs and nothing can start: finished loads hold the blocks a request
        at the head needs. They give them back (cached on the GPU now, to be hit when
        they are admitted) and wait as plain requests; whether any did. (vLLM would
        wait here for a request to leave, and none would.)"""
        done = [r for r in self.waiting if r.loading_until is not None and r.loading_until <= now]
        for request in done:
            self._loaded(request)
            self._free(request)
            request.loading_until = None
            request.num_computed = 0
        return bool(done)

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        block_tokens = self.pool.block_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            new = min(request.num_tokens - request.num_computed, budget)
            need = _blocks_for(request.num_computed + new, block_tokens) - len(request.blocks)
            while need > self.pool.num_free:
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RUNNING:
                break
            if need > 0:
                request.blocks += self.pool.allocate(need)
            plan.work.append((request, new, request.num_computed))
            budget -= new
            index += 1
        return budget

    def prefix_hit(self, request: SimRequest) -> tuple[list[int], int]:
        """The cached blocks ``request`` would start from if admitted now, and how many
        of them are free (``BlockPool.prefix_hit``): the longest run of its leading full
        blocks whose chained hash is registered. A hit never covers the last token: at
        least one token must be computed."""
        pool = self.pool
        hit, free = pool.prefix_hit(request.hashes, (request.num_tokens - 1) // pool.block_tokens)
        if self.windows is not None and hit:
            kept = self.windows.limit(request.hashes, len(hit))
            if kept < len(hit):
                hit = hit[:kept]
                free = pool.free_among(hit)
        return hit, free

    def cached_tokens(self, request: SimRequest) -> int:
        """The tokens of ``request`` a hit would cover now (``prefix_hit``)."""
        return len(self.prefix_hit(request)[0]) * self.pool.block_tokens

    def _schedule_waiting(self, plan: StepPlan, budget: int, now: float) -> None:
        """Admit waiting requests first come, first served. A request whose prefix
        continues in the offload tier first waits for it to load (its blocks held, out
        of the queue's way, as vLLM's WAITING_FOR_REMOTE_KVS), then is admitted from
        there."""
        pool, block_tokens = self.pool, self.pool.block_tokens
        loading: list[SimRequest] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.loading_until is not None:
                if request.loading_until > now:
                    loading.append(self.waiting.popleft())
                    continue
                self._loaded(request)
                hit, hit_free = request.blocks, 0
                computed = request.num_computed
            else:
                hit, hit_free = self.prefix_hit(request)
                computed = len(hit) * block_tokens
                if self.windows is not None:
                    request.window_junction = self._junction(request, len(hit))
                if self._start_load(request, hit, hit_free, plan, now):
                    loading.append(self.waiting.popleft())
                    continue
            new = min(request.num_tokens - computed, budget)
            need = _blocks_for(computed + new, block_tokens) - len(hit)
            if need + hit_free > pool.num_free:
                break
            self.waiting.popleft()
            if request.loading_until is None:  # a loaded request's blocks are its own
                pool.touch(hit)
            request.blocks = hit + pool.allocate(need)
            request.num_computed = computed
            first_try = request.num_preemptions == 0 and not request.loaded_tokens
            if first_try and request.loading_until is None:
                request.cached_tokens = computed
                plan.prefix_queries.append((request.num_tokens, computed))
                if self.offload is not None:  # looked there, found nothing to load
                    plan.offload_queries.append((request.num_tokens - computed, 0))
            request.loading_until = None
            request.status = RUNNING
            self.running.append(request)
            plan.work.append((request, new, computed))
            budget -= new
        self.waiting.extendleft(reversed(loading))

    def _start_load(
        self, request: SimRequest, hit: list[int], hit_free: int, plan: StepPlan, now: float
    ) -> bool:
        """Start loading what continues ``request``'s GPU hit from the offload tier, if
        anything does and the blocks for it are free; whether it started."""
        offload, pool = self.offload, self.pool
        if offload is None:
            return False
        block_tokens = pool.block_tokens
        limit = (request.num_tokens - 1) // block_tokens
        found = offload.continuation(request.hashes, len(hit), limit)
        if not found or found + hit_free > pool.num_free:
            return False
        # Counted once, when it is scheduled (here: its load starts), as vLLM counts it.
        first_try = request.num_preemptions == 0 and not request.loaded_tokens
        if first_try:
            plan.offload_queries.append(
                (request.num_tokens - len(hit) * block_tokens, found * block_tokens)
            )
        offload.touch(request.hashes[len(hit) : len(hit) + found])
        pool.touch(hit)
        request.blocks = hit + pool.allocate(found)
        request.loaded_from = len(hit)
        request.num_computed = (len(hit) + found) * block_tokens
        if first_try:
            request.cached_tokens = request.num_computed
            request.loaded_tokens = found * block_tokens
            plan.prefix_queries.append((request.num_tokens, len(hit) * block_tokens))
        request.loading_until = now + found * self.load_seconds_per_block
        return True

    def _loaded(self, request: SimRequest) -> None:
        """``request``'s load from the offload tier ended: the GPU caches what it read
        (once: a loaded request may wait several steps for room)."""
        full = request.num_computed // self.pool.block_tokens
        if request.loaded_from < full:
            self._cache(request, request.loaded_from, full)
            request.loaded_from = full

    def decode_span(self, plan: StepPlan, limit: int) -> int:
        """Steps (at most ``limit``) that ``plan``'s batch runs unchanged if nothing
        arrives or leaves: 1 unless every running request is decoding and was already
        streaming; else up to the first finish and while free blocks last.

        Nothing waiting could join in those steps: a waiting request was not admitted
        into the first one for want of seats or blocks, and decoding only uses blocks.
        """
        work = plan.work
        if plan.preempted or len(work) != len(self.running) or not work:
            return 1
        for request, new, context in work:
            if new != 1 or request.first_token_at is None or context != request.num_tokens - 1:
                return 1
        span = min(limit, min(r.max_output - r.output_tokens for r, _, _ in work))
        if span <= 1 or self._decode_blocks(work, span) <= self.pool.num_free:
            return max(span, 1)
        low, high = 1, span  # the blocks for step 1 are allocated; find the last that fits
        while low < high:
            middle = (low + high + 1) // 2
            if self._decode_blocks(work, middle) <= self.pool.num_free:
                low = middle
            else:
                high = middle - 1
        return low

    def _decode_blocks(self, work: list[tuple[SimRequest, int, int]], steps: int) -> int:
        """Blocks to allocate beyond those held so each request can decode ``steps``."""
        block_tokens = self.pool.block_tokens
        return sum(
            max(0, _blocks_for(context + steps, block_tokens) - len(request.blocks))
            for request, _, context in work
        )

    def complete_decode(self, plan: StepPlan, done: int, times: list[float]) -> StepOutcome:
        """Apply decode steps ``done + 1 .. done + len(times)`` of a span from
        ``decode_span``, the i-th ending at ``times[i]``; step 1 is ``complete``'s."""
        outcome = StepOutcome()
        pool, block_tokens = self.pool, self.pool.block_tokens
        steps, end = len(times), done + len(times)
        # Every block the steps need is taken before any request finishes and frees its
        # own, as step by step: the steps' blocks are allocated when they are scheduled.
        for request, _, context in plan.work:
            if request.status is not RUNNING:
                continue  # aborted while the span ran
            need = _blocks_for(context + end, block_tokens) - len(request.blocks)
            if need > 0:
                request.blocks += pool.allocate(need)
        for request, _, context in plan.work:
            if request.status is not RUNNING:
                continue
            first = request.num_computed // block_tokens  # the first block not yet full
            request.append_generated(block_tokens, steps)
            request.num_computed = context + end
            full = request.num_computed // block_tokens
            if full > first:
                self._cache(request, first, full)
            request.token_times += times
            outcome.advanced.append(request)
            if request.output_tokens >= request.max_output:
                self._finish(request, times[-1])
                outcome.finished.append(request)
        if self.events is not None:
            self.events.flush()
        return outcome

    def complete(self, plan: StepPlan, now: float) -> StepOutcome:
        """Apply a step's computation: cache full blocks, sample tokens, finish requests."""
        outcome = StepOutcome()
        block_tokens = self.pool.block_tokens
        for request, new, context in plan.work:
            if request.status is not RUNNING:
                continue  # aborted while the step ran
            request.num_computed = context + new
            first, full = context // block_tokens, request.num_computed // block_tokens
            if full > first:  # cache the blocks this step filled
                self._cache(request, first, full)
            if request.num_computed < request.num_tokens:
                continue  # prefill chunk, no token yet
            if request.first_token_at is None:
                request.first_token_at = now
                outcome.first_tokens.append(request)
                if self.windows is not None:
                    self._retain(request)
            request.append_generated(block_tokens)
            request.token_times.append(now)
            outcome.advanced.append(request)
            if request.output_tokens >= request.max_output:
                self._finish(request, now)
                outcome.finished.append(request)
        if self.events is not None:
            self.events.flush()
        return outcome

    def _junction(self, request: SimRequest, hit: int) -> int:
        """Where the full-attention hit ended, if the window groups cut it short (0: they
        did not): a prefix shared with a cached prompt, whose window they keep next."""
        pool = self.pool
        limit = (request.num_tokens - 1) // pool.block_tokens
        full = len(pool.prefix_hit(request.hashes, limit)[0])
        return full if full > hit else 0

    def _retain(self, request: SimRequest) -> None:
        """Its prompt computed: each window group keeps the window before its end (and
        before its junction), in blocks of the pool, freed at once to its free queue
        (as far as the pool has room)."""
        windows, pool = self.windows, self.pool
        assert windows is not None
        block_tokens = pool.block_tokens
        indexes = windows.to_keep(
            request.hashes, request.prompt_tokens, block_tokens, request.window_junction
        )
        for group in range(windows.groups):
            kept = [i for i in indexes if pool.num_free and self._keep(group, request.hashes[i])]
            if kept and self.events is not None:
                first = request.cached_tokens // block_tokens
                self.events.window_stored(request, first, kept, group)

    def _keep(self, group: int, pool_hash: int) -> bool:
        assert self.windows is not None
        key = self.windows.key(group, pool_hash)
        if key is None:
            return False
        (block,) = self.pool.allocate(1)
        self.pool.register(block, key)
        self.pool.release([block])
        return True

    def _finish(self, request: SimRequest, now: float) -> None:
        self.running.remove(request)
        if self.offload is not None:
            self.offload.touch(request.hashes)
        self._free(request)
        request.status = FINISHED
        request.finish_reason = request.end_reason
        request.finished_at = now

    def _preempt(self, request: SimRequest) -> None:
        self._free(request)
        request.num_computed = 0
        request.num_preemptions += 1
        request.status = WAITING
        self.waiting.appendleft(request)

    def _free(self, request: SimRequest) -> None:
        self.pool.release(request.blocks)
        request.blocks = []

    def reset(self) -> list[SimRequest]:
        """Drop every request and the whole cache (an engine restart); returns the ones
        that were dropped. A restarted process announces nothing of the old one's cache:
        its KV events start anew (``Engine.restart``)."""
        dropped = [*self.running, *self.waiting]
        for request in dropped:
            request.status = FINISHED
            request.finish_reason = "abort"
        self.running.clear()
        self.waiting.clear()
        self.pool.reset()
        if self.offload is not None:
            self.offload.reset()
        if self.windows is not None:
            self.windows.reset()
        return dropped

    def reset_prefix_cache(self, reset_running: bool = False) -> tuple[bool, list[SimRequest]]:
        """vLLM's ``Scheduler.reset_prefix_cache``: with ``reset_running``, every running
        request is preempted first (newest first, so they wait in their order); then the
        cache is forgotten if no block is held, announced as ``AllBlocksCleared`` with
        the next step's events. Returns whether it was, and the requests preempted."""
        preempted: list[SimRequest] = []
        if reset_running:
            while self.running:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
        if self.pool.num_free < self.pool.num_blocks:
            return False, preempted
        self.pool.reset()
        if self.windows is not None:
            self.windows.reset()
        if self.events is not None:
            self.events.cleared()
        return True, preempted
