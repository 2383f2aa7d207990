"""The shared state's sync loops against a real redis-server: what reaches Redis and the
other replicas when sends fail, Redis is cut off, the stream is trimmed under a replica,
or several replicas see one engine restart. Each replica here is the router's own
``RedisSync`` and ``SharedPrefixIndex`` in this process (no HTTP), so the tests can cut
one replica off through a proxy while the others keep Redis."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, cast

import pytest
import redis.asyncio as aioredis

from router.clock import monotonic
from router.config import StateConfig
from router.fleet.workers import Fleet, Worker
from router.index.residency import LocalPrefixIndex
from router.observability.metrics import RouterMetrics
from router.replication.connect import connect
from router.replication.events import decode
from router.replication.index import SharedPrefixIndex
from router.replication.metrics import RESYNC_REASONS, RedisMetrics
from router.replication.outbox import Outbox
from router.replication.sync import RedisSync
from router.routing.learning import PrefillRate
from router.routing.policy_slot import PolicySlot
from tests.conftest import RedisServer
from tests.router_client import wait_for
from tests.tcp_proxy import tcp_proxy

WORKERS = ("w0", "w1")
CAPACITY_BLOCKS = 10_000
NAMESPACE = "kvrouter"
STREAM = f"kvr:{{{NAMESPACE}}}:events"


def residency_key(worker: str) -> str:
    return f"kvr:{{{NAMESPACE}}}:res:{worker}"


@dataclass
class Replica:
    index: SharedPrefixIndex
    sync: RedisSync
    metrics: RouterMetrics
    fleet: Fleet
    task: asyncio.Task[None] | None = None

    def run(self) -> None:
        self.task = asyncio.create_task(self.sync.run())

    def counter(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def holds(self, worker: str, hashes: list[int]) -> bool:
        return self.index.match(worker, hashes) == len(hashes)


@contextlib.asynccontextmanager
async def replica(
    url: str, outbox: Outbox | None = None, running: bool = True, **state: Any
) -> AsyncIterator[Replica]:
    """A replica's sync, started (warm from Redis); its loops run unless not ``running``."""
    fleet, local = Fleet(), LocalPrefixIndex()
    index = SharedPrefixIndex(local, outbox)
    for name in WORKERS:
        fleet.add(Worker(name, f"http://{name}", CAPACITY_BLOCKS * 64))
        index.add_worker(name, CAPACITY_BLOCKS)
    metrics = RouterMetrics(fleet, index, 64)
    config = StateConfig(url=url, flush_interval_s=0.005, load_interval_s=0.05, **state)
    handle = connect(url)
    sync = RedisSync(
        handle.client,
        index,
        fleet,
        PrefillRate(),
        PolicySlot("round_robin", {}, 0, metrics),
        config,
        RedisMetrics(metrics.registry),
    )
    await sync.start()
    running_replica = Replica(index, sync, metrics, fleet)
    if running:
        running_replica.run()
    try:
        yield running_replica
    finally:
        sync.stop()
        if running_replica.task is not None:
            await asyncio.wait_for(running_replica.task, 10)
        await handle.aclose()


def chain(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


async def failed(cut: Replica, *ops: str) -> None:
    """Wait until each of the replica's ``ops`` has failed."""
    for op in ops:
        await wait_for(lambda op=op: _true(cut.counter("kvrouter_redis_errors_total", op=op) > 0))


def resyncs(r: Replica) -> dict[str, float]:
    return {
        reason: r.counter("kvrouter_redis_resyncs_total", reason=reason)
        for reason in RESYNC_REASONS
    }


async def resynced(r: Replica, reason: str) -> bool:
    return r.counter("kvrouter_redis_resyncs_total", reason=reason) > 0


async def _true(value: bool) -> bool:
    return value


async def test_a_change_whose_send_failed_still_reaches_the_other_replicas(
    redis_server: RedisServer, redis_url: str
) -> None:
    async with (
        tcp_proxy(redis_server.port) as proxy,
        replica(proxy.url) as a,
        replica(redis_url) as b,
    ):
        proxy.cut()
        a.index.touch("w0", chain(1, 8))  # queued while Redis is out of reach
        await failed(a, "publish", "subscribe")
        proxy.restore()
        # b never lost Redis, so it does not resync: it learns the change from the stream.
        await wait_for(lambda: _true(b.holds("w0", chain(1, 8))))
        assert b.counter("kvrouter_redis_resyncs_total", reason="redis_error") == 0


async def test_a_purge_made_while_redis_was_away_is_not_undone_by_the_resync(
    redis_server: RedisServer, redis_url: str
) -> None:
    async with tcp_proxy(redis_server.port) as proxy, replica(proxy.url) as a:
        a.index.touch("w0", chain(1, 8))
        await wait_for(
            lambda: _true(a.counter("kvrouter_redis_index_events_total", direction="out") > 0)
        )
        proxy.cut()
        a.index.purge("w0", started_at=1_000.0)  # the engine restarted meanwhile
        await failed(a, "publish", "subscribe", "load")
        proxy.restore()
        await wait_for(
            lambda: _true(a.counter("kvrouter_redis_resyncs_total", reason="redis_error") > 0)
        )
        assert a.index.resident_blocks("w0") == 0
        client = aioredis.Redis.from_url(redis_url)
        try:
            assert await client.zcard(residency_key("w0")) == 0
        finally:
            await client.aclose()


async def test_the_loops_that_meet_an_error_resync_one_at_a_time(
    redis_server: RedisServer, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with tcp_proxy(redis_server.port) as proxy, replica(proxy.url) as a:
        running, most = 0, 0
        read_snapshot = a.sync._read_snapshot

        async def counted() -> None:
            nonlocal running, most
            running += 1
            most = max(most, running)
            try:
                await asyncio.sleep(0.05)  # long enough for every loop to arrive
                await read_snapshot()
            finally:
                running -= 1

        monkeypatch.setattr(a.sync, "_read_snapshot", counted)
        proxy.cut()
        a.index.touch("w0", chain(1, 8))
        await failed(a, "publish", "subscribe", "load")  # each loop wants a resync
        proxy.restore()
        await wait_for(lambda: resynced(a, "redis_error"))
        await asyncio.sleep(0.3)  # every loop has been round since
        assert most == 1
        assert resyncs(a)["start"] == 1
        assert a.holds("w0", chain(1, 8))


async def test_a_full_outbox_is_bounded_by_hashes_and_resyncs_what_it_dropped(
    redis_server: RedisServer, redis_url: str
) -> None:
    outbox = Outbox(max_hashes=1_000)
    async with tcp_proxy(redis_server.port) as proxy, replica(proxy.url, outbox) as a:
        proxy.cut()
        a.index.purge("w1")
        await failed(a, "publish")
        for prompt in range(30):  # 30 prompts of 100 blocks: three times the bound
            a.index.touch("w0", chain(prompt * 1_000, 100))
            assert outbox.hashes <= 1_000
        proxy.restore()
        await wait_for(lambda: _true(not outbox))
        assert a.counter("kvrouter_redis_outbox_dropped_events_total") > 0
        # What was dropped reaches Redis all the same: the resync writes the index back.
        client = aioredis.Redis.from_url(redis_url)
        try:

            async def written() -> bool:
                return await client.zcard(residency_key("w0")) == 3_000

            await wait_for(written)
            entries = await client.xrange(STREAM)
            ops = [decode(cast(dict[bytes, bytes], fields)) for _, fields in entries or ()]
            assert [event.op for _, event in filter(None, ops)].count("purge") == 1
        finally:
            await client.aclose()


async def test_a_replica_behind_the_trimmed_stream_notices_and_resyncs(redis_url: str) -> None:
    async with replica(redis_url, stream_retention_s=0.2) as a:
        a.index.touch("w0", chain(1, 4))
        await wait_for(lambda: _true(not a.index.outbox))
        async with replica(redis_url, running=False, stream_retention_s=0.2) as b:
            assert b.holds("w0", chain(1, 4))  # read from the residency sets at start
            # b does not read the stream while a writes past its retention: the first
            # change after b's start is trimmed before b reads it.
            a.index.touch("w0", chain(100, 4))
            for i in range(150):
                a.index.touch("w1", chain(10_000 + i * 10, 4))
            await wait_for(lambda: _true(not a.index.outbox))
            await asyncio.sleep(0.3)
            for i in range(150):
                a.index.touch("w1", chain(20_000 + i * 10, 4))
            await wait_for(lambda: _true(not a.index.outbox))
            b.run()
            await wait_for(lambda: resynced(b, "stream_gap"))
            assert b.holds("w0", chain(100, 4))
            assert resyncs(b) == {
                "start": 1,
                "redis_error": 0,
                "stream_gap": 1,
                "outbox_overflow": 0,
                "repaired": 0,
            }


async def test_only_the_first_purge_of_an_engine_restart_wipes_its_entries(
    redis_url: str,
) -> None:
    async with replica(redis_url) as a, replica(redis_url) as b:
        a.index.touch("w0", chain(1, 8))
        await wait_for(lambda: _true(b.holds("w0", chain(1, 8))))
        a.index.purge("w0", started_at=2_000.0)  # a notices the restart first
        await wait_for(lambda: _true(b.index.resident_blocks("w0") == 0))
        b.index.touch("w0", chain(100, 8))  # traffic after the restart, through b
        await wait_for(lambda: _true(a.holds("w0", chain(100, 8))))
        b.index.purge("w0", started_at=2_000.0)  # b notices the same restart later
        a.index.touch("w0", chain(200, 2))
        await wait_for(lambda: _true(b.holds("w0", chain(200, 2))))  # b's purge went by
        assert a.holds("w0", chain(100, 8)) and b.holds("w0", chain(100, 8))
        client = aioredis.Redis.from_url(redis_url)
        try:
            assert await client.zcard(residency_key("w0")) == 10
        finally:
            await client.aclose()
        a.index.purge("w0", started_at=3_000.0)  # a second restart purges again
        await wait_for(lambda: _true(b.index.resident_blocks("w0") == 0))


async def test_a_late_purge_of_the_same_restart_leaves_redis_alone(
    redis_server: RedisServer, redis_url: str
) -> None:
    """b is cut off when a purges a restart and records new blocks; b's own purge of the
    same restart reaches Redis later and must not wipe them there."""
    async with (
        tcp_proxy(redis_server.port) as proxy,
        replica(redis_url) as a,
        replica(proxy.url) as b,
    ):
        a.index.touch("w0", chain(1, 8))
        await wait_for(lambda: _true(b.holds("w0", chain(1, 8))))
        proxy.cut()
        await failed(b, "subscribe")
        a.index.purge("w0", started_at=5_000.0)
        a.index.touch("w0", chain(100, 8))  # after the restart
        await wait_for(lambda: _true(not a.index.outbox))
        b.index.purge("w0", started_at=5_000.0)  # b has not heard of a's purge
        proxy.restore()
        await wait_for(lambda: resynced(b, "redis_error"))
        client = aioredis.Redis.from_url(redis_url)
        try:
            await wait_for(lambda: _true(not b.index.outbox))
            assert await client.zcard(residency_key("w0")) == 8
        finally:
            await client.aclose()
        assert a.holds("w0", chain(100, 8)) and b.holds("w0", chain(100, 8))


async def test_recent_demand_and_queued_prefill_reach_the_other_replicas(redis_url: str) -> None:
    """New sessions are placed beside the least recent demand once caches are full, and
    sessions leave a worker whose queue outweighs their cache; each replica sends only
    part of both, so each must hear the others' or they pile sessions onto the worker
    each of them alone has sent least to, and keep them there."""
    async with replica(redis_url) as a, replica(redis_url) as b:
        a.fleet.workers["w0"].demand.add(50_000, monotonic())
        b.fleet.workers["w1"].demand.add(20_000, monotonic())
        a.fleet.workers["w1"].queued_prefill_tokens = 7_000

        async def heard() -> bool:
            now = monotonic()
            return (
                b.fleet.workers["w0"].remote_demand.value(now) > 40_000
                and a.fleet.workers["w1"].remote_demand.value(now) > 15_000
            )

        await wait_for(heard)
        # The prefill queued on a worker by another replica, as one router sees it all.
        assert b.fleet.workers["w1"].remote_queued_prefill == 7_000
        assert a.fleet.workers["w1"].remote_queued_prefill == 0
        now = monotonic()
        # Each hears only the other's: its own is not counted twice.
        assert a.fleet.workers["w0"].remote_demand.value(now) == 0
        assert b.fleet.workers["w1"].remote_demand.value(now) == 0
        # It fades as the replica's own does, from when it was heard.
        later = b.fleet.workers["w0"].remote_demand.value(now + 30)
        assert 0.4 < later / b.fleet.workers["w0"].remote_demand.value(now) < 0.6


async def test_what_no_replica_could_have_written_is_skipped_and_the_rest_applies(
    redis_url: str,
) -> None:
    """Garbage, a negative count and an infinite rate from replicas that are not
    kvrouter: each skipped and counted; the real replicas' load still arrives, and the
    loops go on replicating."""
    ns = f"kvr:{{{NAMESPACE}}}"
    raw = aioredis.from_url(redis_url)
    async with replica(redis_url) as a, replica(redis_url) as b:
        await raw.hset(f"{ns}:load:x", mapping={"w0": "garbage", "w1": "3,300,0,0"})
        await raw.hset(f"{ns}:load:y", mapping={"w0": "-1,5"})
        await raw.set(f"{ns}:rate:x", "inf,5")
        # Alive a while yet (a score far ahead of the clock is not: it never lapses).
        await raw.zadd(f"{ns}:replicas", {"x": time.time() + 30, "y": time.time() + 30})
        a.fleet.workers["w0"].outstanding_requests = 4
        workers = b.fleet.workers

        async def heard() -> bool:
            return workers["w0"].remote_requests == 4 and workers["w1"].remote_requests == 3

        await wait_for(heard)
        for kind in ("load", "rate"):
            assert b.counter("kvrouter_redis_bad_entries_total", kind=kind) >= 1, kind
        assert b.sync._rate.tokens_per_s < float("inf")
        a.index.touch("w0", chain(1, 8))
        await wait_for(lambda: _true(b.holds("w0", chain(1, 8))))
        assert b.task is not None and not b.task.done()
    await raw.aclose()


async def test_a_stream_entry_or_a_residency_member_that_is_not_one_is_counted(
    redis_url: str,
) -> None:
    raw = aioredis.from_url(redis_url)
    await raw.zadd(residency_key("w0"), {(1).to_bytes(8, "big"): 1.0, b"short": 2.0})
    async with replica(redis_url) as a:
        assert a.holds("w0", [1])
        assert a.counter("kvrouter_redis_bad_entries_total", kind="residency") == 1
        await raw.xadd(STREAM, {"r": "intruder", "o": "?"})
        await wait_for(
            lambda: _true(a.counter("kvrouter_redis_bad_entries_total", kind="stream") == 1)
        )
    await raw.aclose()


async def test_a_loop_that_fails_unexpectedly_is_started_again_alone(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with replica(redis_url) as a, replica(redis_url) as b:
        follow = b.sync._follow_policy
        failures = iter([RuntimeError("surprise")] * 3)

        async def failing_then_well() -> None:
            error = next(failures, None)
            if error is not None:
                raise error
            await follow()

        monkeypatch.setattr(b.sync, "_follow_policy", failing_then_well)
        await wait_for(
            lambda: _true(b.counter("kvrouter_redis_loop_failures_total", loop="share") == 3)
        )
        a.index.touch("w0", chain(1, 8))  # the other loops never stopped
        await wait_for(lambda: _true(b.holds("w0", chain(1, 8))))
        a.fleet.workers["w1"].outstanding_requests = 2  # and the failed one came back
        await wait_for(lambda: _true(b.fleet.workers["w1"].remote_requests == 2))
    logged = [r for r in caplog.records if "loop failed" in r.getMessage()]
    assert len(logged) == 1  # once, not once a failure


# -- what the Redis-side fuzz found (tests/replication/test_fuzz_redis.py) ----------------


async def test_a_replica_name_that_is_not_text_is_skipped_and_load_still_shared(
    redis_url: str,
) -> None:
    """It ended the share loop at every round (UnicodeDecodeError) for as long as it
    stayed in the register: no replica's load was heard again."""
    raw = aioredis.from_url(redis_url)
    await raw.zadd(f"kvr:{{{NAMESPACE}}}:replicas", {b"\xff\xfe": time.time() + 30})
    async with replica(redis_url) as a, replica(redis_url) as b:
        a.fleet.workers["w0"].outstanding_requests = 5
        await wait_for(lambda: _true(b.fleet.workers["w0"].remote_requests == 5))
        assert b.counter("kvrouter_redis_bad_entries_total", kind="replica") >= 1
        assert b.counter("kvrouter_redis_loop_failures_total", loop="share") == 0
    await raw.aclose()


async def test_a_register_stuffed_with_names_is_read_only_as_far_as_a_fleet_goes(
    redis_url: str,
) -> None:
    """50,000 names alive at once: each round asked Redis for every one's load and rate.
    And 300 "seen in the future", which never lapse: read first, they hid the real
    replicas for good."""
    raw = aioredis.from_url(redis_url)
    now = time.time()
    register = f"kvr:{{{NAMESPACE}}}:replicas"
    await raw.zadd(register, {f"crowd-{i}": now for i in range(50_000)})
    await raw.zadd(register, {f"future-{i}": now + 1e6 for i in range(300)})
    async with replica(redis_url) as a, replica(redis_url) as b:
        a.fleet.workers["w0"].outstanding_requests = 6
        await wait_for(lambda: _true(b.fleet.workers["w0"].remote_requests == 6))
        assert b.sync.peers <= 256
        skipped = sum(r.counter("kvrouter_redis_bad_entries_total", kind="replica") for r in (a, b))
        assert skipped >= 300  # the future names, by whichever replica met them first
    await raw.aclose()


@pytest.mark.parametrize("key", ["res:w0", "events", "replicas", "policy", "restarts"])
async def test_a_key_of_another_type_is_deleted_and_replication_goes_on(
    redis_url: str, key: str
) -> None:
    """A string where kvrouter keeps a set, a stream or a hash failed every command on
    it, and a pipeline with it: the replica took Redis for unreachable and resynced for
    as long as the key stayed (for ever: nothing expires it)."""
    raw = aioredis.from_url(redis_url)
    full = f"kvr:{{{NAMESPACE}}}:{key}"
    # A lost stream is noticed at the next look for a gap (a quarter of the retention).
    async with (
        replica(redis_url, stream_retention_s=1.0) as a,
        replica(redis_url, stream_retention_s=1.0) as b,
    ):
        await raw.delete(full)
        await raw.set(full, b"not what kvrouter keeps here")
        a.index.touch("w0", chain(100, 8))
        a.index.purge("w1", started_at=time.time())  # PURGE_ONCE reads the restarts hash
        await wait_for(lambda: _true(b.holds("w0", chain(100, 8))))
        a.fleet.workers["w1"].outstanding_requests = 3
        await wait_for(lambda: _true(b.fleet.workers["w1"].remote_requests == 3))
        kept = await raw.type(full)
        assert kept != b"string"
        repaired = a.counter("kvrouter_redis_bad_entries_total", kind="type")
        repaired += b.counter("kvrouter_redis_bad_entries_total", kind="type")
        assert repaired >= 1
        for r in (a, b):
            assert r.counter("kvrouter_redis_loop_failures_total", loop="publish") == 0
            assert r.sync.up
    await raw.aclose()


async def test_a_restart_recorded_as_garbage_does_not_stop_the_purges(redis_url: str) -> None:
    """PURGE_ONCE compared the stored start with tonumber() of garbage (nil): a script
    error on every publish that carried a purge of that worker."""
    raw = aioredis.from_url(redis_url)
    await raw.hset(f"kvr:{{{NAMESPACE}}}:restarts", "w0", "garbage")
    async with replica(redis_url) as a, replica(redis_url) as b:
        a.index.touch("w0", chain(1, 4))
        await wait_for(lambda: _true(b.holds("w0", chain(1, 4))))
        a.index.purge("w0", started_at=time.time())
        await wait_for(lambda: _true(not b.holds("w0", chain(1, 1))))
        assert a.counter("kvrouter_redis_errors_total", op="publish") == 0
    await raw.aclose()


async def test_a_stream_entry_past_any_prompt_is_skipped_before_it_is_unpacked(
    redis_url: str,
) -> None:
    """A million hashes (8 MB) in one entry: unpacked into a million ints and touched
    into the index, a stall of the loop and a jump in memory for each."""
    raw = aioredis.from_url(redis_url)
    async with replica(redis_url) as a:
        huge = (1).to_bytes(8, "little") * 1_000_000
        await raw.xadd(STREAM, {"r": "intruder", "o": "t", "w": "w0", "h": huge})
        await wait_for(
            lambda: _true(a.counter("kvrouter_redis_bad_entries_total", kind="stream") == 1)
        )
        assert not a.holds("w0", [1])
    await raw.aclose()


async def test_a_policy_key_retyped_while_it_is_being_restored_is_repaired_again(
    redis_url: str,
) -> None:
    """The long Redis fuzz: the policy key repaired (it held another type), then written
    as another type again before this replica restored the fleet's policy into it; the
    restore met WRONGTYPE and the replica took Redis for unreachable."""
    raw = aioredis.from_url(redis_url)
    key = f"kvr:{{{NAMESPACE}}}:policy"
    async with replica(redis_url) as a:
        await raw.hset(key, mapping={"version": 3, "policy": "round_robin", "knobs": "{}"})
        await wait_for(lambda: _true(a.sync._policies.current.version == 3))
        repair = a.sync.repairs.repair
        retyped = 0

        async def repair_then_retype(candidates: Iterable[Any]) -> int:
            nonlocal retyped
            repaired = await repair(candidates)
            if retyped == 0:
                retyped += 1
                await raw.set(key, b"written between the repair and the restore")
            return repaired

        a.sync.repairs.repair = repair_then_retype  # type: ignore[method-assign]
        await raw.delete(key)
        await raw.set(key, b"not a hash")

        async def restored() -> bool:
            return await raw.type(key) == b"hash" and await raw.hget(key, "version") == b"3"

        await wait_for(restored)
        assert retyped == 1
        assert a.counter("kvrouter_redis_errors_total", op="policy") == 0
        assert a.sync.up
    await raw.aclose()


async def test_a_policy_hash_rewritten_with_garbage_is_not_logged_each_time(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each new garbage was a new WARNING: anyone writing to Redis could fill the log."""
    raw = aioredis.from_url(redis_url)
    async with replica(redis_url) as a:
        for i in range(5):
            await raw.hset(f"kvr:{{{NAMESPACE}}}:policy", mapping={"version": f"x{i}"})
            # Until a load round has read it (they run every load_interval_s).
            await asyncio.sleep(0.3)
        assert a.task is not None and not a.task.done()
    logged = [r for r in caplog.records if "policy is not valid here" in r.getMessage()]
    assert len(logged) == 1
    await raw.aclose()
