"""Keeps replicas in step through Redis; never on a request's path.

* publisher: every ``flush_interval_s``, the queued index changes go out in one pipeline:
  each worker's residency as a sorted set (score = last touch, trimmed to the worker's
  capacity, with a TTL) and the changes themselves on a stream for live replicas;
* subscriber: reads the stream and applies other replicas' changes to the local mirror;
* load sharer: every ``load_interval_s``, this replica's load per worker (outstanding
  requests and tokens, recent demand, queued prefill) and its learned prefill rate go to
  Redis with a TTL (a crashed replica's load expires), and
  the other live replicas' figures come back into ``Worker.remote_*`` and the rate; then
  the fleet's routing policy is read and a newer one installed (``router/replication/policy.py``);
* at start, and whenever Redis comes back after a failure, the residency sets are read
  (a restarted router starts warm) and this replica's own state is pushed back (Redis
  restarted empty rebuilds from the replicas and from traffic).

Redis unreachable: every loop logs once, counts errors, backs off and keeps going; routing
continues on local state and no request waits on Redis. What Redis holds is read as
untrusted (``router.replication.remote``): a bad entry is skipped and counted, never the end
of a loop; and a loop that fails for any other reason is logged, counted
(``kvrouter_redis_loop_failures_total``) and started again after a backoff, on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from router.clock import monotonic
from router.config import AdmissionConfig, StateConfig
from router.config_loader import build
from router.errors import SharedStateUnavailable
from router.fleet.workers import Fleet
from router.observability.sparse_log import SparseLog
from router.replication import policy as fleet_policy
from router.replication import scripts
from router.replication.events import IndexEvent, decode, encode
from router.replication.index import SharedPrefixIndex
from router.replication.keys import Keys, member, touch_scores
from router.replication.metrics import RedisMetrics
from router.replication.remote import block_hashes, parse_load, parse_rate
from router.replication.repair import KeyRepaired, Repairs, is_wrong_type, queued_keys
from router.replication.scripts import StreamPosition
from router.routing.learning import PrefillRate
from router.routing.policy_slot import PolicySlot
from router.routing.queue import RequestQueue

log = logging.getLogger(__name__)

MAX_BATCH = 512
READ_BLOCK_MS = 250
BACKOFF_MAX_S = 5.0
PEERS_HOLD_S = 10.0
# A replica's shared load lives at least this long (ms): a short load_interval_s must
# not let a busy replica's load lapse between two of its shares.
LOAD_TTL_MIN_MS = 2_000
# Replicas read from the register, the latest seen first: far more than any fleet runs,
# so a register stuffed with names costs a bounded read.
MAX_REPLICAS = 256
MAX_REPLICA_NAME = 64  # a replica names itself with 12 hex digits
MAX_RATE_BYTES = 64  # "tokens_per_s,samples": a longer value is no replica's
# How far ahead of this replica's clock another's may run.
CLOCK_SKEW_S = 60.0
# RedisClusterException is no RedisError: a cluster whose nodes are all unreachable raises it.
REDIS_ERRORS = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)


class RedisSync:
    def __init__(
        self,
        client: Redis | RedisCluster,
        index: SharedPrefixIndex,
        fleet: Fleet,
        rate: PrefillRate,
        policies: PolicySlot,
        config: StateConfig,
        metrics: RedisMetrics,
        queue: RequestQueue | None = None,
    ) -> None:
        self._redis = client
        self._queue = queue  # the router's queue, whose settings the fleet shares
        self._index = index
        self._fleet = fleet
        self._rate = rate  # blended with the other replicas' rates
        self._policies = policies
        self._config = config
        self._metrics = metrics
        self.replica = uuid.uuid4().hex[:12]
        self._replica_bytes = self.replica.encode()
        self._keys = Keys(config.namespace)
        self._policy_key = self._keys.policy
        self.repairs = Repairs(
            client, self._keys, metrics.bad_entries, lambda: self._resync_for("repaired")
        )
        # The fleet's policy hash as last refused (not valid here), so it is warned about once.
        self._refused_policy: dict[bytes, bytes] = {}
        self._refused_admission: dict[bytes, bytes] = {}
        self._cursor = "0-0"
        self._read = 0  # entries read off the stream, counted as Redis counts entries added
        self._snapshots = 0  # resyncs that read Redis's copy
        self._gap_check_at = 0.0
        self.up = False
        self.peers = 0  # other live replicas, as of the last load share
        self._peers_seen_at = float("-inf")
        # Why the next resync is wanted (a ``RESYNC_REASONS`` entry); None: in step.
        self._resync_reason: str | None = "start"
        self._resyncing = asyncio.Lock()
        self._publishing = asyncio.Lock()
        self._stopping = asyncio.Event()
        self._failed_loops: set[str] = set()  # loops whose failure has been logged
        self._sparse = SparseLog(log)  # what anyone writing to Redis can make it say

    # -- health -------------------------------------------------------------------------

    async def _op(
        self, name: str, call: Awaitable[Any], keys: Sequence[Any] = (), empty: Any = None
    ) -> Any:
        """``call``'s result. A Redis error marks Redis down and is raised; one for a key
        of ``keys`` holding another type repairs the key and returns ``empty``."""
        start = time.perf_counter()
        try:
            result = await call
        except REDIS_ERRORS as exc:
            if not (keys and is_wrong_type(exc)):
                self._failed(name, exc)
                raise
            await self._repair(name, keys)
            return empty
        self._metrics.seconds.labels(name).observe(time.perf_counter() - start)
        if not self.up:
            log.info("redis reachable")
            self.up = True
            self._metrics.up.set(1)
        return result

    def _failed(self, name: str, exc: BaseException) -> None:
        self._metrics.errors.labels(name).inc()
        if self.up:
            log.warning("redis unreachable (%s: %r); routing on local state", name, exc)
        self._resync_for("redis_error")
        self.up = False
        self._metrics.up.set(0)

    async def _repair(self, name: str, keys: Sequence[Any]) -> None:
        """Keys of another type deleted (and the index written anew: ``Repairs``)."""
        try:
            await self.repairs.repair(keys)
        except REDIS_ERRORS as exc:
            self._failed(name, exc)
            raise

    async def _execute(self, name: str, pipe: Any, index_writes: bool = False) -> list[Any]:
        """A pipeline's results (a wrong-typed key's as its error). Keys of another type
        its commands met are repaired; with ``index_writes`` that raises ``KeyRepaired``,
        so that the writes are sent again whole, the stream's entries among them. Any
        other error is a Redis error, raised."""
        keys = queued_keys(pipe)
        results: list[Any] = await self._op(name, pipe.execute(raise_on_error=False))
        try:
            met, other = await self.repairs.after(results, keys)
        except REDIS_ERRORS as exc:
            self._failed(name, exc)
            raise
        if met and index_writes:
            raise KeyRepaired(f"{name}: a key of another type was deleted")
        if other is not None:
            self._failed(name, other)
            raise other
        return results

    async def _loop(self, name: str, step: Callable[[], Awaitable[None]], pause: float) -> None:
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                if self._resync_reason is not None:
                    await self._resync()
                await step()
                backoff = 0.1
                await self._pause(pause)
            except REDIS_ERRORS:
                await self._pause(backoff)
                backoff = min(BACKOFF_MAX_S, backoff * 2)
            except Exception:  # one loop's surprise must end neither it nor the others
                if name not in self._failed_loops:
                    self._failed_loops.add(name)
                    log.exception("the shared state's %s loop failed; restarting it", name)
                self._metrics.loop_failures.labels(name).inc()
                await self._pause(backoff)
                backoff = min(BACKOFF_MAX_S, backoff * 2)

    async def _pause(self, seconds: float) -> None:
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), seconds)

    async def run(self) -> None:
        """The three loops, until ``stop()``.

        Loops end by checking a flag rather than by cancellation: redis-py can leave a
        cancelled blocking read (XREAD BLOCK) waiting forever, so reads block briefly
        and the loops look at the flag between them.
        """
        config = self._config
        async with asyncio.TaskGroup() as group:
            group.create_task(self._loop("publish", self._publish, config.flush_interval_s))
            group.create_task(self._loop("subscribe", self._subscribe, 0))
            group.create_task(self._loop("share", self._share, config.load_interval_s))

    def stop(self) -> None:
        self._stopping.set()

    async def start(self) -> None:
        """Start warm from Redis if it is there; carry on cold if not (the loops resync
        when it comes)."""
        try:
            await self._resync()
            await self._follow_policy()
            await self._follow_admission()
        except REDIS_ERRORS:
            log.warning(
                "redis unreachable at start; starting with an empty index and the configured policy"
            )

    async def flush(self, timeout_s: float) -> None:
        """Send what is still queued (on shutdown); give up quietly if Redis is away."""
        with contextlib.suppress(*REDIS_ERRORS):
            await asyncio.wait_for(self._send_outbox(), timeout_s)

    # -- resync: snapshot in, own state out -----------------------------------------------

    def _resync_for(self, reason: str) -> None:
        if self._resync_reason is None:
            self._resync_reason = reason

    async def _resync(self) -> None:
        """Redis's copy in, this replica's own out. The loops that notice an error all
        call this at once; one resync does it for all of them."""
        async with self._resyncing:
            reason, self._resync_reason = self._resync_reason, None
            if reason is None:
                return
            try:
                self._count_dropped()  # this resync writes them back
                # Changes not sent yet go first: a purge made while Redis was away must
                # reach it before its copy is merged in, or the purged entries would return.
                # The publisher waits meanwhile, so nothing it sends lands between
                # reading a set and writing it back.
                async with self._publishing:
                    await self._send_queued()
                    await self._read_snapshot()
            except BaseException:
                self._resync_reason = reason
                raise
            self._metrics.resyncs.labels(reason).inc()

    async def _read_snapshot(self) -> None:
        position = await self._stream_position("resync")
        self._cursor, self._read = position.last_id, position.added
        self._snapshots += 1  # a stream read begun before this is out of date
        local = self._index.local
        for worker in local.workers():
            key = self._keys.residency(worker)
            members = await self._op("resync", self._redis.zrange(key, 0, -1), (key,), [])
            local.restore(worker, block_hashes(members, self._metrics.bad_entries))
        for worker in local.workers():
            own = local.oldest_first(worker)
            if own:
                await self._write_residency(worker, own)
        log.info("shared index synchronised: %d entries", local.size())

    async def _write_residency(self, worker: str, oldest_first: list[int]) -> None:
        now = time.time() * 1000
        key = self._keys.residency(worker)
        step = 1.0 / max(1, len(oldest_first))
        mapping = {member(h): now - 1 + i * step for i, h in enumerate(oldest_first)}
        pipe = self._redis.pipeline(transaction=False)
        pipe.zadd(key, mapping)
        self._trim(pipe, worker, key)
        await self._execute("resync", pipe, index_writes=True)

    def _trim(self, pipe: Any, worker: str, key: str) -> None:
        capacity = self._index.local.capacity_blocks(worker)
        if capacity > 0:  # 0: removed here meanwhile; the others may still use the set
            pipe.zremrangebyrank(key, 0, -(capacity + 1))
        pipe.pexpire(key, int(self._config.key_ttl_s * 1000))

    # -- publisher ------------------------------------------------------------------------

    async def _publish(self) -> None:
        if self._count_dropped():
            self._resync_for("outbox_overflow")  # the next step writes the whole index
            return
        await self._send_outbox()

    def _count_dropped(self) -> int:
        dropped = self._index.outbox.take_dropped()
        if dropped:
            self._metrics.outbox_dropped.inc(dropped)
        return dropped

    async def _send_outbox(self) -> None:
        """Send the outbox, oldest first; a change leaves it once Redis has it."""
        async with self._publishing:
            await self._send_queued()

    async def _send_queued(self) -> None:
        """What is queued now, not what arrives meanwhile: under a steady backlog the
        loop still comes round (to count overflows, to let a resync in)."""
        outbox = self._index.outbox
        pending = len(outbox)
        while pending > 0 and outbox:
            generation, batch = outbox.peek(min(MAX_BATCH, pending))
            await self._send(batch)
            outbox.sent(generation, len(batch))
            pending -= len(batch)
            self._metrics.events.labels("out").inc(len(batch))

    async def _send(self, batch: list[IndexEvent]) -> None:
        """One pipeline: each event on the stream, and the residency sets changed as the
        events say in order. A worker's touches in a batch become one ZADD (a later
        touch's scores win, as they would one after another) and one trim: nearly every
        event is a touch, and its three commands were most of the sync's CPU."""
        pipe = self._redis.pipeline(transaction=False)
        now = time.time() * 1000
        oldest = f"{int(now - self._config.stream_retention_s * 1000)}-0"
        touched: dict[str, dict[bytes, float]] = {}

        def write_touches(worker: str) -> None:
            mapping = touched.pop(worker, None)
            if mapping:
                key = self._keys.residency(worker)
                pipe.zadd(key, mapping)
                self._trim(pipe, worker, key)

        for event in batch:
            if event.op == "touch":
                touched.setdefault(event.worker, {}).update(touch_scores(event.hashes, now))
            else:
                write_touches(event.worker)  # before a forget or purge of the same worker
                key = self._keys.residency(event.worker)
                if event.op == "forget":
                    pipe.zrem(key, *(member(h) for h in event.hashes))
                elif event.started is None:
                    pipe.delete(key)
                else:  # a restart: only the first replica's purge of it wipes the set
                    pipe.eval(
                        scripts.PURGE_ONCE,
                        2,
                        self._keys.restarts,
                        key,
                        event.worker,
                        repr(event.started),
                        int(self._config.key_ttl_s * 1000),
                    )
            pipe.xadd(
                self._keys.stream,
                encode(event, self.replica),  # type: ignore[arg-type]
                minid=oldest,
                approximate=True,
            )
        for worker in list(touched):
            write_touches(worker)
        await self._execute("publish", pipe, index_writes=True)

    # -- subscriber -----------------------------------------------------------------------

    async def _subscribe(self) -> None:
        if await self._fell_behind():
            self._resync_for("stream_gap")
            return
        snapshot = self._snapshots
        stream = self._keys.stream
        response = await self._op(
            "subscribe",
            self._redis.xread({stream: self._cursor}, count=MAX_BATCH, block=READ_BLOCK_MS),
            (stream,),
        )
        if snapshot != self._snapshots:
            return  # a resync read Redis's copy meanwhile: these entries are in it
        for _, entries in response or ():
            for entry_id, fields in entries:
                self._cursor = entry_id.decode()
                self._read += 1
                if fields.get(b"r") == self._replica_bytes:
                    continue  # our own, read back: not even unpacked
                decoded = decode(fields)
                if decoded is None:
                    self._metrics.bad_entries.skipped("stream", fields)
                    continue
                self._index.apply(decoded[1])
                self._metrics.events.labels("in").inc()

    async def _fell_behind(self) -> bool:
        """Entries this replica has not read were trimmed off the stream (it was paused
        or slow for longer than the stream keeps them): what they said is only in the
        residency sets now. Looked at a few times per retention period, not every read."""
        now = time.monotonic()
        if now < self._gap_check_at:
            return False
        self._gap_check_at = now + self._config.stream_retention_s / 4
        position = await self._stream_position("subscribe")
        return position.missed(self._read)

    async def _stream_position(self, op: str) -> StreamPosition:
        stream = self._keys.stream
        reply = await self._op(
            op, self._redis.eval(scripts.STREAM_POSITION, 1, stream), (stream,), (0, 0, "0-0")
        )
        return StreamPosition.from_reply(reply)

    # -- load and rates, the policy --------------------------------------------------------

    def has_peers(self) -> bool:
        """Other replicas were live lately. Sticky for a while: a replica whose load
        share came late (a busy machine) must not make the others drop read-your-writes
        for a turn."""
        hold = max(PEERS_HOLD_S, 10 * self._config.load_interval_s)
        return time.monotonic() - self._peers_seen_at < hold

    async def _share(self) -> None:
        await self._share_load()
        await self._follow_policy()
        await self._follow_admission()

    async def _share_load(self) -> None:
        fleet, rate = self._fleet, self._rate
        ttl = max(LOAD_TTL_MIN_MS, int(self._config.load_interval_s * 3000))
        now = time.time()
        # Per worker: outstanding requests and tokens, the recent demand new sessions are
        # placed by, and the prefill queued there (which keeps a session off a worker
        # busy with other replicas' prompts, as one router sees the whole queue).
        moment = monotonic()
        load = {
            w.name: f"{w.outstanding_requests},{w.outstanding_tokens},"
            f"{w.demand.value(moment):.0f},{w.queued_prefill_tokens}"
            for w in fleet.all()
        }
        pipe = self._redis.pipeline(transaction=False)
        if load:
            pipe.hset(self._keys.load_prefix + self.replica, mapping=load)  # type: ignore[arg-type]
            pipe.pexpire(self._keys.load_prefix + self.replica, ttl)
        pipe.set(
            self._keys.rate_prefix + self.replica, f"{rate.tokens_per_s},{rate.samples}", px=ttl
        )
        register = self._keys.replicas
        pipe.zadd(register, {self.replica: now})
        pipe.zremrangebyscore(register, "-inf", now - ttl / 1000)
        # No replica is seen in the future: such a name would never lapse.
        pipe.zremrangebyscore(register, f"({now + CLOCK_SKEW_S}", "+inf")
        pipe.zrevrangebyscore(register, "+inf", "-inf", start=0, num=MAX_REPLICAS)
        results = await self._execute("load", pipe)
        if isinstance(results[-2], int) and results[-2]:
            self._metrics.bad_entries.skipped(
                "replica", "a replica seen in the future", results[-2]
            )
        others = self._other_replicas(results[-1])
        self.peers = len(others)
        if others:
            self._peers_seen_at = time.monotonic()
        self._metrics.replicas.set(1 + self.peers)
        # Only the workers this replica has: whatever else a load entry holds is not read.
        names = [w.name for w in fleet.all()]
        pipe = self._redis.pipeline(transaction=False)
        for other in others:
            if names:
                pipe.hmget(self._keys.load_prefix + other, names)
            pipe.getrange(self._keys.rate_prefix + other, 0, MAX_RATE_BYTES)  # one byte more
        replies = await self._execute("load", pipe) if others else []
        step = 2 if names else 1
        loads = replies[0::step] if names else []
        self._apply_remote(names, loads, replies[step - 1 :: step])

    def _other_replicas(self, register: object) -> list[str]:
        """The other live replicas' names, from the register (the latest seen first);
        a name no replica could have (not text, too long) is skipped and counted."""
        if not isinstance(register, list):  # the register was of another type: repaired
            return []
        others, bad = [], self._metrics.bad_entries
        for raw in register:
            try:
                name = raw.decode()
            except UnicodeDecodeError:
                bad.skipped("replica", raw)
                continue
            if len(name) > MAX_REPLICA_NAME or not name.isprintable():
                bad.skipped("replica", raw)
            elif name != self.replica:
                others.append(name)
        return others

    def _apply_remote(self, names: list[str], loads: list[object], rates: list[object]) -> None:
        """The other replicas' load (requests, tokens, demand, queued prefill) on the
        workers this replica knows (``names``, in the order each load lists them), and
        their prefill rates. A value of the wrong type (a repaired key) counts as none."""
        bad = self._metrics.bad_entries
        totals: dict[str, list[int]] = {}
        for load in loads:
            if not isinstance(load, list):
                continue
            for name, value in zip(names, load, strict=False):
                if value is None:
                    continue
                parts = parse_load(value)
                if parts is None:
                    bad.skipped("load", value)
                    continue
                acc = totals.setdefault(name, [0, 0, 0, 0])
                for i, part in enumerate(parts):
                    acc[i] += part
        moment = monotonic()
        for w in self._fleet.all():
            requests, tokens, demand, queued = totals.get(w.name, (0, 0, 0, 0))
            w.remote_requests, w.remote_tokens, w.remote_queued_prefill = requests, tokens, queued
            w.remote_demand.reset(demand, moment)
        shared_rates = []
        for shared in rates:
            if not isinstance(shared, bytes) or not shared:
                continue  # none, or of another type (repaired)
            rate = parse_rate(shared) if len(shared) <= MAX_RATE_BYTES else None
            if rate is None:
                bad.skipped("rate", shared)
            else:
                shared_rates.append(rate)
        self._rate.blend(shared_rates)

    # -- the routing policy ---------------------------------------------------------------

    async def publish_policy(self, name: str, knobs: Mapping[str, Any], own_version: int) -> int:
        """Number a policy change for the whole fleet (the ``PolicySlot`` publisher)."""
        return await self._publish_versioned("policy", self._policy_key, name, knobs, own_version)

    async def publish_admission(self, settings: Mapping[str, Any], own_version: int) -> int:
        """Number a change of the queue's settings for the whole fleet (the
        ``RequestQueue`` publisher). ``batch_api_keys`` stays each replica's own: secrets
        are not written to Redis."""
        key = self._keys.admission
        shared = _shared(settings)
        return await self._publish_versioned("admission", key, "admission", shared, own_version)

    async def _publish_versioned(
        self, what: str, key: str, name: str, payload: Mapping[str, Any], own_version: int
    ) -> int:
        """Write a change to one of the fleet's versioned hashes; its fleet version."""
        try:
            for _ in range(2):  # again once if the key was of another type (repaired)
                change = self._redis.eval(
                    fleet_policy.CHANGE,
                    1,
                    key,
                    own_version,
                    name,
                    fleet_policy.encode_knobs(payload),
                )
                version = await self._op(what, change, (key,))
                if version is not None:
                    return int(version)
        except REDIS_ERRORS as exc:
            raise SharedStateUnavailable(
                f"the shared state (Redis) is unreachable, so the {what} was not changed: {exc}"
            ) from exc
        raise SharedStateUnavailable(f"the fleet's {what} key could not be written")

    async def _restore_versioned(
        self, what: str, key: str, version: int, name: str, payload: Mapping[str, Any]
    ) -> None:
        """Write back a versioned hash Redis lost (only over an older version)."""
        encoded = fleet_policy.encode_knobs(payload)
        restore = self._redis.eval(fleet_policy.RESTORE, 1, key, version, name, encoded)
        # Written as another type again since: repaired again.
        await self._op(what, restore, (key,))

    async def _follow_admission(self) -> None:
        """Install the fleet's queue settings if newer than this replica's."""
        queue, key = self._queue, self._keys.admission
        if queue is None:
            return
        fields = await self._op("admission", self._redis.hgetall(key), (key,), {})
        if not fields:
            if queue.settings_version > 0:  # Redis lost it: the fleet's settings go back
                settings = _shared(dataclasses.asdict(queue.limits))
                version = queue.settings_version
                await self._restore_versioned("admission", key, version, "admission", settings)
            return
        try:
            fleet = fleet_policy.decode(fields)
            if fleet.version <= queue.settings_version:
                return
            own = {"batch_api_keys": queue.limits.batch_api_keys}
            limits = build(AdmissionConfig, {**fleet.knobs, **own}, "admission")
        except ValueError as exc:  # ConfigError too: another kvrouter version's settings
            if fields != self._refused_admission:
                self._sparse.warning(
                    "admission", "the fleet's queue settings are not valid here: %s", exc
                )
            self._refused_admission = fields
            return
        queue.install(limits, fleet.version)

    async def _follow_policy(self) -> None:
        slot = self._policies
        key = self._policy_key
        fields = await self._op("policy", self._redis.hgetall(key), (key,), {})
        current = slot.current
        if not fields:
            if current.version > 0:  # Redis lost it: the fleet's policy goes back
                await self._restore_versioned(
                    "policy", key, current.version, current.name, current.knobs
                )
            return
        try:
            fleet = fleet_policy.decode(fields)
            if fleet.version <= current.version:
                return
            candidate = slot.build(fleet.name, fleet.knobs, fleet.version)
        except ValueError as exc:  # PolicyConfigError too: another kvrouter version's policy
            if fields != self._refused_policy:
                self._sparse.warning(
                    "policy",
                    "the fleet's routing policy is not valid here; keeping %s: %s",
                    current.name,
                    exc,
                )
            self._refused_policy = fields
            return
        slot.install(candidate)


def _shared(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The queue's settings as the fleet shares them: without the client keys."""
    return {k: v for k, v in settings.items() if k != "batch_api_keys"}
