"""Exact mode's residency and its subscriber: an engine's KV events over real ZMQ
sockets on loopback, applied in sequence, with the gaps, restarts and bad batches an
operator's fleet produces."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq.asyncio
from prometheus_client import CollectorRegistry

from bench.ports import free_port_run
from router.config import KvEventsConfig
from router.fleet.workers import Fleet, Worker
from router.index.events import AllBlocksCleared
from router.index.events import BlockRemoved as Removed
from router.index.events import BlockStored as Stored
from router.index.exact import ExactResidency
from router.index.residency import LocalPrefixIndex
from router.kv_events.metrics import KvEventMetrics
from router.kv_events.subscriber import (
    MAX_MESSAGE_BYTES,
    YIELD_EVERY,
    Exactness,
    RankEndpoints,
    RankSubscriber,
)
from router.kv_events.subscriptions import KvEventSubscriptions
from router.routing.learning import ResidencyCalibrator
from tests.kv_publisher import (
    BLOCK,
    ScriptedPublisher,
    removed,
    router_hashes,
    scripted_publisher,
    stored,
    tokens,
)

CAPACITY = 1000  # blocks


def announced(ids: list[int], first: int, parent: int | None = None) -> Stored:
    return Stored(tuple(range(first, first + len(ids) // BLOCK)), parent, tuple(ids), BLOCK)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- the residency, from plain values -----------------------------------------------------


def test_announced_blocks_are_held_until_removed_or_cleared() -> None:
    residency = ExactResidency(CAPACITY, "m", ttl_s=5.0)
    a = tokens(1, 4)
    residency.apply(0, [announced(a, 10)])
    assert residency.longest_prefix(router_hashes(a), {}) == 4
    residency.apply(0, [Removed((12, 13))])  # the engine evicts the tail first
    assert residency.longest_prefix(router_hashes(a), {}) == 2
    assert residency.evictions == 2
    residency.apply(0, [AllBlocksCleared()])
    assert residency.longest_prefix(router_hashes(a), {}) == 0
    assert len(residency) == 0


def test_a_requests_blocks_count_until_announced_or_their_ttl_lapses() -> None:
    clock = Clock()
    residency = ExactResidency(CAPACITY, "m", ttl_s=5.0, clock=clock)
    a, b = tokens(1, 3), tokens(2, 3)
    residency.touch(router_hashes(a))
    residency.touch(router_hashes(b))
    assert residency.longest_prefix(router_hashes(a), {}) == 3
    residency.apply(0, [announced(a, 10)])  # a is announced; b never is
    clock.now = 5.1
    assert residency.longest_prefix(router_hashes(a), {}) == 3
    assert residency.longest_prefix(router_hashes(b), {}) == 0
    assert len(residency) == 3  # guesses are not residents


def test_inherited_entries_give_way_as_announced_blocks_fill_the_capacity() -> None:
    old = tokens(9, 4)
    residency = ExactResidency(6, "m", ttl_s=5.0, inherited=router_hashes(old))
    assert residency.longest_prefix(router_hashes(old), {}) == 4
    residency.apply(0, [announced(tokens(1, 4), 10)])  # 4 announced + 4 inherited > 6
    assert len(residency) == 6
    assert residency.longest_prefix(router_hashes(old), {}) == 0  # its oldest went first


def test_a_block_two_ranks_hold_stays_until_both_remove_it() -> None:
    residency = ExactResidency(CAPACITY, "m", ttl_s=5.0)
    a = tokens(1, 2)
    residency.apply(0, [announced(a, 10)])
    residency.apply(1, [announced(a, 10)])
    residency.apply(0, [Removed((10, 11))])
    assert residency.longest_prefix(router_hashes(a), {}) == 2
    residency.clear_rank(1)
    assert residency.longest_prefix(router_hashes(a), {}) == 0


def test_the_index_turns_exact_keeping_what_it_modelled_and_back() -> None:
    index = LocalPrefixIndex()
    index.add_worker("w", CAPACITY)
    a, b = tokens(1, 2), tokens(2, 2)
    index.touch("w", router_hashes(a))
    index.make_exact("w", "m", 5.0)
    assert index.prefix_mode("w") == "exact"
    assert index.match("w", router_hashes(a)) == 2  # inherited
    assert index.apply_events("w", 0, [announced(b, 10)])
    assert index.match("w", router_hashes(b)) == 2
    index.purge("w")
    assert index.prefix_mode("w") == "exact"
    assert index.match("w", router_hashes(a)) == index.match("w", router_hashes(b)) == 0
    index.apply_events("w", 0, [announced(b, 10)])
    index.make_approximate("w")
    assert index.prefix_mode("w") == "approximate"
    assert index.match("w", router_hashes(b)) == 2
    assert not index.apply_events("w", 0, [announced(a, 20)])


# -- the subscriber over real sockets -------------------------------------------------------


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


class Subscribed:
    def __init__(self, index: LocalPrefixIndex, subscriber: RankSubscriber, worker: Worker) -> None:
        self.index = index
        self.subscriber = subscriber
        self.worker = worker
        self.registry = CollectorRegistry()

    def match(self, ids: list[int]) -> int:
        return self.index.match("w", router_hashes(ids))

    def count(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, {"worker": "w", **labels})
        return value or 0.0


@contextlib.asynccontextmanager
async def subscribed(
    publisher: ScriptedPublisher, replay: bool = True, block_tokens: int = BLOCK
) -> AsyncIterator[Subscribed]:
    context = zmq.asyncio.Context()
    index = LocalPrefixIndex()
    index.add_worker("w", CAPACITY)
    worker = Worker("w", "http://127.0.0.1:1", CAPACITY * BLOCK, base_model="m")
    registry = CollectorRegistry()
    metrics = KvEventMetrics(registry)
    metrics.worker_added("w")
    endpoints = RankEndpoints(
        0, publisher.endpoint, publisher.replay_endpoint if replay else None, b""
    )
    subscriber = RankSubscriber(
        context, worker, endpoints, index, Exactness(block_tokens, 5.0, 0.5), metrics
    )
    task = asyncio.create_task(subscriber.run())
    result = Subscribed(index, subscriber, worker)
    result.registry = registry
    try:
        if not replay:  # nothing tells it the engine is there but a batch it receives
            probe = tokens(99, 1)
            while index.prefix_mode("w") != "exact" and not task.done():
                await publisher.publish(stored(probe, 990, None))
                await asyncio.sleep(0.02)
        await until(lambda: index.prefix_mode("w") == "exact" or subscriber.rejected is not None)
        yield result
        assert not task.done(), task  # nothing a worker sent ended the subscriber
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        context.destroy(linger=0)


async def test_a_subscriber_that_joins_late_replays_what_the_engine_announced() -> None:
    a, b = tokens(1, 4), tokens(2, 2)
    async with scripted_publisher() as engine:
        await engine.publish(stored(a[: 2 * BLOCK], 10, None))  # nobody listens yet
        await engine.publish(stored(a[2 * BLOCK :], 12, 11))
        async with subscribed(engine) as sub:
            await until(lambda: sub.match(a) == 4)
            await engine.publish(stored(b, 20, None))
            await until(lambda: sub.match(b) == 2)
            await engine.publish(removed(12, 13))
            await until(lambda: sub.match(a) == 2)
            assert sub.count("kvrouter_kv_event_replays_total", result="complete") == 1
            assert sub.count("kvrouter_kv_events_total", type="stored") == 3
            assert sub.count("kvrouter_kv_events_total", type="removed") == 1


async def test_a_burst_of_queued_batches_is_applied_in_order_without_holding_the_loop() -> None:
    chain = tokens(4, 200)
    async with scripted_publisher() as engine, subscribed(engine) as sub:
        ticks = 0
        applied_at: list[int] = []  # the loop's tick at each batch applied
        apply_events = sub.index.apply_events

        def recording(*args: Any) -> bool:
            applied_at.append(ticks)
            return apply_events(*args)

        sub.index.apply_events = recording  # type: ignore[method-assign,assignment]

        async def ticking() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(ticking())
        # Sent without yielding, so they queue in the SUB; one block a batch, each the
        # child of the last: applied out of order, a block would be an orphan.
        for i in range(200):
            parent = 100 + i - 1 if i else None
            await engine.publish(stored(chain[i * BLOCK : (i + 1) * BLOCK], 100 + i, parent))
        await until(lambda: sub.match(chain) == 200)
        ticker.cancel()
        assert len(applied_at) == 200
        assert sub.count("kvrouter_kv_event_gaps_total") == 0
        longest = max(len(list(run)) for _, run in itertools.groupby(applied_at))
        assert longest <= YIELD_EVERY  # the loop ran between every few batches


async def test_a_gap_in_the_live_stream_is_filled_from_the_replay_endpoint() -> None:
    a, c = tokens(1, 4), tokens(3, 1)
    async with scripted_publisher() as engine, subscribed(engine) as sub:
        await engine.publish(stored(a[: 2 * BLOCK], 10, None))
        await engine.publish(stored(a[2 * BLOCK :], 12, 11), live=False)  # lost
        await engine.publish(stored(c, 30, None))
        await until(lambda: sub.match(c) == 1)
        assert sub.match(a) == 4
        assert sub.count("kvrouter_kv_event_gaps_total") == 1
        assert sub.count("kvrouter_kv_event_replays_total", result="complete") == 2
        assert sub.count("kvrouter_kv_event_resets_total", reason="gap") == 0


async def test_a_gap_the_engine_no_longer_keeps_drops_the_rank_and_rebuilds() -> None:
    a, c = tokens(1, 2), tokens(3, 1)
    async with scripted_publisher() as engine, subscribed(engine) as sub:
        await engine.publish(stored(a, 10, None))
        await until(lambda: sub.match(a) == 2)
        lost = await engine.publish(removed(10, 11), live=False)
        engine.forget_before(lost + 1)  # rolled out of the engine's buffer
        await engine.publish(stored(c, 30, None))
        await until(lambda: sub.match(c) == 1)
        # The lost batch may have evicted a: the router under-counts, never over-counts.
        assert sub.match(a) == 0
        assert sub.count("kvrouter_kv_event_replays_total", result="incomplete") == 1
        assert sub.count("kvrouter_kv_event_resets_total", reason="gap") == 1


async def test_a_gap_without_a_replay_endpoint_drops_the_rank_and_rebuilds() -> None:
    a, c = tokens(1, 2), tokens(3, 1)
    async with scripted_publisher(replay=False) as engine, subscribed(engine, False) as sub:
        await engine.publish(stored(a, 10, None))
        await until(lambda: sub.match(a) == 2)
        await engine.publish(removed(10, 11), live=False)
        await engine.publish(stored(c, 30, None))
        await until(lambda: sub.match(c) == 1)
        assert sub.match(a) == 0
        assert sub.count("kvrouter_kv_event_resets_total", reason="gap") == 1


async def test_an_engine_restart_drops_what_the_old_process_announced() -> None:
    a, b = tokens(1, 2), tokens(2, 2)
    async with scripted_publisher() as engine, subscribed(engine) as sub:
        await engine.publish(stored(a, 10, None))
        await engine.publish(stored(tokens(5, 1), 50, None))
        await until(lambda: sub.match(a) == 2)
        engine.restart()  # its sequence begins again at 0
        await engine.publish(stored(b, 20, None))
        await until(lambda: sub.match(b) == 2)
        assert sub.match(a) == 0
        assert sub.count("kvrouter_kv_event_resets_total", reason="restart") == 1


async def test_an_engine_block_of_whole_router_blocks_is_held_as_them() -> None:
    a = tokens(1, 4)  # four of the router's blocks, two of the engine's
    async with scripted_publisher() as engine, subscribed(engine) as sub:
        await engine.publish(stored(a, 10, None, block_size=2 * BLOCK))
        await until(lambda: sub.match(a) == 4)
        assert sub.subscriber.rejected is None and sub.index.prefix_mode("w") == "exact"
        assert sub.worker.engine_block_tokens == 2 * BLOCK
        await engine.publish(removed(11))  # the engine's second block: two of the router's
        await until(lambda: sub.match(a) == 2)


async def test_blocks_that_are_not_whole_router_blocks_keep_the_worker_approximate() -> None:
    a = tokens(1, 2)
    async with scripted_publisher() as engine, subscribed(engine, block_tokens=2 * BLOCK) as sub:
        await engine.publish(stored(a, 10, None))  # half the router's block each
        await until(lambda: sub.subscriber.rejected is not None)
        assert str(sub.subscriber.rejected).endswith("(set prefix.block_bytes: 64)")
        assert sub.index.prefix_mode("w") == "approximate"
        assert sub.count("kvrouter_kv_event_rejected_blocks_total") == 2
        await engine.publish(stored(a, 40, None, block_size=2 * BLOCK))
        await asyncio.sleep(0.1)
        assert sub.index.prefix_mode("w") == "approximate"


async def test_a_batch_that_cannot_be_read_costs_the_rank_not_the_subscriber() -> None:
    a, b = tokens(1, 2), tokens(2, 2)
    async with scripted_publisher() as engine, subscribed(engine) as sub:
        await engine.publish(stored(a, 10, None))
        await until(lambda: sub.match(a) == 2)
        await engine.publish(payload=b"\xc1 not msgpack")
        await engine.publish(stored(b, 20, None))
        await until(lambda: sub.match(b) == 2)
        assert sub.match(a) == 0  # what the unread batch did is unknown
        assert sub.count("kvrouter_kv_event_resets_total", reason="malformed") == 1


def test_an_exact_workers_capacity_is_not_calibrated_from_its_hit_rate() -> None:
    index = LocalPrefixIndex()
    calibrator = ResidencyCalibrator(index, BLOCK)
    for name in ("modelled", "announced"):
        index.add_worker(name, CAPACITY)
    index.make_exact("announced", "m", 5.0)
    for name in ("modelled", "announced"):
        worker = Worker(name, "http://127.0.0.1:1", CAPACITY * BLOCK)
        calibrator.observe(worker, predicted=1000, cached=0, prompt=1000)
    assert index.capacity_blocks("modelled") < CAPACITY
    assert index.capacity_blocks("announced") == CAPACITY


async def test_each_data_parallel_rank_is_followed_and_a_removed_worker_let_go() -> None:
    base = free_port_run(2)
    fleet, index = Fleet(), LocalPrefixIndex()
    worker = Worker("w", "http://127.0.0.1:1", CAPACITY * BLOCK, base_model="m")
    fleet.add(worker)
    index.add_worker("w", CAPACITY)
    config = KvEventsConfig(endpoint=f"tcp://{{host}}:{base}", data_parallel_size=2)
    subscriptions = KvEventSubscriptions(
        fleet, index, config, BLOCK, KvEventMetrics(CollectorRegistry())
    )
    a, b = tokens(1, 2), tokens(2, 2)
    async with (
        scripted_publisher(False, base) as rank0,
        scripted_publisher(False, base + 1) as rank1,
    ):
        subscriptions.reconcile()
        try:
            # No replay endpoint: the ranks are found by what they send.
            while index.match("w", router_hashes(b)) < 2:
                await rank0.publish(stored(a, 10, None))
                await rank1.publish(stored(b, 10, None))  # the same engine hashes, rank 1's
                await asyncio.sleep(0.02)
            assert index.match("w", router_hashes(a)) == 2
            await rank1.publish(removed(10, 11))
            await until(lambda: index.match("w", router_hashes(b)) == 0)
            assert index.match("w", router_hashes(a)) == 2  # rank 0's blocks stay
            fleet.remove("w")
            subscriptions.reconcile()
            assert subscriptions.subscribed() == []
            assert index.prefix_mode("w") == "approximate"
        finally:
            await subscriptions.aclose()


async def test_a_message_past_the_size_bound_is_never_read_and_costs_a_gap() -> None:
    a, c = tokens(1, 2), tokens(3, 1)
    async with scripted_publisher() as engine, subscribed(engine) as sub:
        await engine.publish(stored(a, 10, None))
        await until(lambda: sub.match(a) == 2)
        await engine.publish(payload=b"\x00" * (MAX_MESSAGE_BYTES + 1))
        # ZMQ drops the connection instead, and does not reconnect after it: the
        # subscriber connects afresh; later batches meet a gap the replay cannot fill
        # (the engine would replay the same message).
        while sub.match(c) == 0:
            await engine.publish(stored(c, 30, None))
            await asyncio.sleep(0.05)
        assert sub.match(a) == 0
        assert sub.count("kvrouter_kv_event_resets_total", reason="gap") >= 1
        assert sub.count("kvrouter_kv_event_resets_total", reason="malformed") == 0


async def test_a_restarted_engines_first_batches_missed_live_are_replayed() -> None:
    a, c = tokens(1, 2), tokens(3, 4)
    async with scripted_publisher() as engine, subscribed(engine) as sub:
        await engine.publish(stored(a, 10, None))
        await engine.publish(stored(tokens(5, 1), 50, None))
        await until(lambda: sub.match(a) == 2)
        engine.restart()
        # The new process's seq 0 goes out before the subscription reaches it.
        await engine.publish(stored(c[: 2 * BLOCK], 30, None), live=False)
        await engine.publish(stored(c[2 * BLOCK :], 32, 31))
        await until(lambda: sub.match(c) == 4)
        assert sub.match(a) == 0
        assert sub.count("kvrouter_kv_event_resets_total", reason="restart") == 1
        assert sub.count("kvrouter_kv_event_resets_total", reason="gap") == 0


# -- what the requests dispatched before will evict ----------------------------------------


def filled(capacity: int) -> tuple[ExactResidency, list[int], list[int]]:
    """Sessions a and b of 4 blocks each, announced and ended, a first (the older)."""
    residency = ExactResidency(capacity, "m", ttl_s=5.0, forecast_queue_evictions=True)
    a, b = tokens(1, 4), tokens(2, 4)
    residency.apply(0, [announced(a, 10), announced(b, 20)])
    residency.touch(router_hashes(a))  # a's request ends, then b's
    residency.touch(router_hashes(b))
    return residency, router_hashes(a), router_hashes(b)


def dispatch(residency: ExactResidency, reserved: Counter[int], hashes: list[int]) -> None:
    """What the index does when it reserves a request's blocks on the worker."""
    reserved.update(hashes)
    residency.dispatched()


def test_blocks_queued_requests_will_need_take_the_oldest_tails_first() -> None:
    residency, a, b = filled(12)
    reserved: Counter[int] = Counter()
    assert residency.longest_prefix(a, reserved) == 4
    dispatch(residency, reserved, router_hashes(tokens(3, 5)))  # 5 new + 1 partial; 4 free
    assert residency.forecast_evictions(reserved) == 2
    assert residency.longest_prefix(a, reserved) == 2  # a's tail goes first
    assert residency.longest_prefix(b, reserved) == 4
    reserved.clear()  # it failed: nothing will be evicted for it
    residency.settled()
    assert residency.longest_prefix(a, reserved) == 4


def test_without_the_forecast_what_the_engine_holds_now_counts() -> None:
    residency = ExactResidency(12, "m", ttl_s=5.0)
    a, b = tokens(1, 4), tokens(2, 4)
    residency.apply(0, [announced(a, 10), announced(b, 20)])
    residency.touch(router_hashes(a))
    reserved: Counter[int] = Counter()
    dispatch(residency, reserved, router_hashes(tokens(3, 5)))
    assert residency.longest_prefix(router_hashes(a), reserved) == 4


def test_blocks_a_queued_request_uses_are_not_evicted_for_the_others() -> None:
    residency, a, b = filled(12)
    reserved: Counter[int] = Counter()
    dispatch(residency, reserved, a)  # a's next turn is queued: a's blocks will be in use
    dispatch(residency, reserved, router_hashes(tokens(3, 5)))
    assert residency.longest_prefix(a, reserved) == 4
    assert residency.longest_prefix(b, reserved) == 1  # 2 partial + 5 new, 4 free: 3 go


def test_the_forecast_gives_way_to_what_the_engine_announces() -> None:
    residency, a, _ = filled(12)
    queued_ids = tokens(3, 5)
    reserved: Counter[int] = Counter()
    dispatch(residency, reserved, router_hashes(queued_ids))
    assert residency.longest_prefix(a, reserved) == 2
    # Scheduled: the engine evicts a's tail and stores the new blocks, in one batch.
    residency.apply(0, [Removed((12, 13)), announced(queued_ids, 30)])
    assert residency.forecast_evictions(reserved) == 0  # the free block is its partial one
    assert residency.longest_prefix(a, reserved) == 2
    reserved.clear()  # its first byte: computed
    residency.settled()
    assert residency.longest_prefix(a, reserved) == 2


def test_the_index_pins_what_it_reserves_on_an_exact_worker() -> None:
    index = LocalPrefixIndex()
    index.add_worker("w", 12)
    index.make_exact("w", "m", 5.0, forecast_queue_evictions=True)
    a, b = tokens(1, 4), tokens(2, 4)
    assert index.apply_events("w", 0, [announced(a, 10), announced(b, 20)])
    index.touch("w", router_hashes(a))
    index.touch("w", router_hashes(b))
    queued = router_hashes(tokens(3, 5))
    index.reserve("w", queued)
    assert index.match("w", router_hashes(a)) == 2
    index.release("w", queued)
    assert index.match("w", router_hashes(a)) == 4
