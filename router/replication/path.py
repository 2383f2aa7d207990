"""Read-your-writes across replicas: the shared state on a request's path.

The sync loops (``router.replication.sync``) keep each replica's mirror of the index some
milliseconds behind the others. That is too late for a session whose next turn goes to
another replica as soon as this one answered (a per-request load balancer, an agent's
quick tool call). So, with ``state.read_your_writes``:

* **lookup**, before the decision: when no local worker holds the session's history (the
  prompt its previous turn sent, ``ClientRequest.history_blocks``), one script call asks
  Redis, per candidate worker, for the longest prefix of the request's chain it holds or
  has reserved, and, for a request with a session key, which worker served the session
  last (its binding): that worker counts as holding at least the history. A local hit
  never waits on Redis.
* **reserve**, after the decision and before the request is forwarded: the prompt's
  blocks as reserved on the chosen worker (a sorted set scored by when the reservation
  lapses), so a sibling arriving at another replica meanwhile finds them.
* **record**, before the final chunk reaches the client: the prompt's and the reply's
  blocks in the worker's residency set, the reservation withdrawn and the session (with
  a key) bound to the worker, so the next turn finds its whole history wherever it
  lands. A session whose worker is gone or too busy goes elsewhere by the policy's
  choice, and is bound there when that turn is recorded.
* **stored responses**: a Responses reply's owner (``router.routing.response_owners``)
  and its conversation's chain (``router.index.stored_chain``), written together
  before the reply's end reaches the client and read together by a request continuing
  it. The chain has a key of its own beside the owner's, so a router that knows no
  chains reads the owner as before; it is read bounded (``MAX_ENCODED_BYTES``) and
  parsed as untrusted: anything else is no chain (the request is keyed blind), counted.

Only while other replicas are live (``RedisSync.has_peers``): alone, a replica's own index
is complete, and one that joins later reads Redis's sets when it starts. Each is one
round trip, bounded by ``state.path_timeout_s``: past it, or when Redis
fails, the request goes on on local state, and the miss is counted. The mirror still
hears of every change through the stream, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from router.apis.request import ClientRequest
from router.config import StateConfig
from router.errors import SharedStateUnavailable
from router.fleet.workers import Worker
from router.index.residency import LocalPrefixIndex
from router.index.stored_chain import MAX_ENCODED_BYTES, StoredChain
from router.replication.keys import Keys, member, touch_scores
from router.replication.metrics import PathMetrics
from router.replication.remote import BadEntries
from router.replication.repair import Repairs, is_wrong_type, queued_keys
from router.replication.scripts import LONGEST_PREFIXES
from router.replication.sync import REDIS_ERRORS
from router.routing.response_owners import MAX_OWNER_BYTES, Owner


def _binding_of(worker: Worker) -> str:
    """What a session's binding holds: the worker, and the start of its engine then (a
    binding to an engine since restarted promises nothing)."""
    return f"{worker.name} {worker.engine_started_at}"


# A reservation lapses after this long if its request never reports back (its replica
# died): long enough for any prefill, short enough not to mislead for long.
RESERVATION_TTL_S = 60.0
WITHDRAW_TIMEOUT_S = 1.0
_UNANSWERED = object()
_WRONG_TYPE = object()  # a read whose key held another type
# Writes past the bound left to finish off the request's path, at most (then cancelled).
MAX_LATE_WRITES = 1024


class SharedPath:
    def __init__(
        self,
        client: Redis | RedisCluster,
        local: LocalPrefixIndex,
        config: StateConfig,
        metrics: PathMetrics,
        peers: Callable[[], bool],
        repairs: Repairs | None = None,
        bad: BadEntries | None = None,
    ) -> None:
        self._redis = client
        self._repairs = repairs  # keys of another type met on the path, deleted off it
        self._bad = bad  # values read that no router wrote, counted
        self._peers = peers  # whether other replicas are live
        self._local = local
        self._keys = Keys(config.namespace)
        self._timeout_s = config.path_timeout_s
        self._key_ttl_ms = int(config.key_ttl_s * 1000)
        self._metrics = metrics
        # Withdrawals of failed dispatches' reservations, sent off the request's path.
        self._background: set[asyncio.Future[Any]] = set()
        # Reservations whose write is landing late, by worker and prompt (router's hashes).
        self._reserving: dict[tuple[str, int, int, int], asyncio.Future[Any]] = {}

    async def lookup(
        self, request: ClientRequest, hashes: Sequence[int], candidates: Sequence[Worker]
    ) -> dict[str, int] | None:
        """Blocks of ``hashes`` each candidate holds according to Redis, when no local
        worker holds the session's history; None when not asked or not answered."""
        need = request.history_blocks
        if not candidates or not self._peers():
            return None
        local = self._local
        if need == 0 or any(local.match(w.name, hashes) >= need for w in candidates):
            self._metrics.skipped.inc()
            return None
        keys = [self._keys.binding(request.session_key)]
        keys += [key for w in candidates for key in self._worker_keys(w.name)]
        now_ms = time.time() * 1000
        reply = await self._bounded(
            "lookup",
            self._redis.eval(
                LONGEST_PREFIXES, len(keys), *keys, now_ms, *(member(h) for h in hashes)
            ),
            count_ok=False,
            keys=keys,
        )
        if reply is None:
            return None
        try:
            bound, *per_worker = reply
            held, indexed = per_worker[0::2], per_worker[1::2]
            matches = {w.name: int(n) for w, n in zip(candidates, held, strict=True)}
            known = {w.name: bool(int(e)) for w, e in zip(candidates, indexed, strict=True)}
            binding = bound.decode() if isinstance(bound, bytes) else None
        except (TypeError, ValueError, UnicodeDecodeError):  # not our script's answer
            self._metrics.operations.labels("lookup", "error").inc()
            return None
        self._metrics.operations.labels("lookup", "ok").inc()
        bound_to = next((w for w in candidates if binding == _binding_of(w)), None)
        # The same engine, not restarted since, holds the history, unless the index says
        # otherwise: where the worker's residency set is kept, it is the truth (its
        # engine evicted the session); the binding stands in only where it is gone.
        if bound_to is not None and not known[bound_to.name]:
            matches[bound_to.name] = max(matches[bound_to.name], need)
        return matches

    async def reserve(self, worker: str, hashes: Sequence[int]) -> None:
        """The prompt was dispatched to ``worker``: its blocks count as held from now."""
        if not hashes or not self._peers():
            return
        now_ms = time.time() * 1000
        key = self._keys.reserved(worker)
        lapses = now_ms + RESERVATION_TTL_S * 1000
        pipe = self._redis.pipeline(transaction=False)
        pipe.zadd(key, dict.fromkeys(map(member, hashes), lapses))
        pipe.zremrangebyscore(key, "-inf", now_ms)
        pipe.pexpire(key, int(RESERVATION_TTL_S * 1000))
        write = asyncio.ensure_future(pipe.execute())
        await self._bounded("reserve", write, finish_late=True, keys=(key,))
        if not write.done():  # landing late: what withdraws it must not land first
            reservation = _reservation(worker, hashes)
            self._reserving[reservation] = write
            write.add_done_callback(lambda _: self._reserving.pop(reservation, None))

    async def record(
        self,
        worker: Worker,
        prompt: Sequence[int],
        reply: Sequence[int],
        session_key: str | None = None,
    ) -> None:
        """``worker`` computed the prompt and the reply: the session's next turn will
        find them on it (head first, so that trimming drops the tail first)."""
        chain = (*prompt, *reply)
        if not chain or not self._peers():
            return
        key = self._keys.residency(worker.name)
        pipe = self._redis.pipeline(transaction=False)
        pipe.zadd(key, touch_scores(chain, time.time() * 1000))
        capacity = self._local.capacity_blocks(worker.name)
        if capacity > 0:  # 0: removed here meanwhile; the others may still use the set
            pipe.zremrangebyrank(key, 0, -(capacity + 1))
        pipe.pexpire(key, self._key_ttl_ms)
        if prompt:
            pipe.zrem(self._keys.reserved(worker.name), *map(member, prompt))
        if session_key is not None:
            binding = self._keys.binding(session_key)
            pipe.set(binding, _binding_of(worker), px=self._key_ttl_ms)
        pending = self._reserving.get(_reservation(worker.name, prompt)) if prompt else None
        keys = [k for named in queued_keys(pipe) or () for k in named]
        await self._bounded("record", _after(pending, pipe.execute), finish_late=True, keys=keys)

    async def remember_response(
        self, response_id: str, owner: Owner, chain: StoredChain | None = None
    ) -> None:
        """``owner`` stored ``response_id`` (whose conversation is ``chain``, where
        known): every replica can find it from now."""
        key = self._keys.response(response_id)
        if chain is None:
            call: Awaitable[Any] = self._redis.set(key, owner.encode(), px=self._key_ttl_ms)
            await self._bounded("remember_response", call, finish_late=True, keys=(key,))
            return
        chain_key = self._keys.response_chain(response_id)
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(chain_key, chain.encode(), px=self._key_ttl_ms)
        pipe.set(key, owner.encode(), px=self._key_ttl_ms)
        call = pipe.execute()
        keys = (key, chain_key)
        await self._bounded("remember_response", call, finish_late=True, keys=keys)

    async def stored_response(self, response_id: str) -> tuple[Owner | None, StoredChain | None]:
        """The worker another replica saw store ``response_id`` (None if none did), and
        the conversation's chain written with it, in one round trip. A chain that is not
        one (garbled, too long, another version's) is None, counted; a key of another
        type is taken as absent and deleted off the path. Redis not answering is not
        "none did": that is a 503, not the engine's 404."""
        key, chain_key = self._keys.response(response_id), self._keys.response_chain(response_id)
        pipe = self._redis.pipeline(transaction=False)
        pipe.getrange(key, 0, MAX_OWNER_BYTES)  # one byte past the most: not an owner
        pipe.getrange(chain_key, 0, MAX_ENCODED_BYTES)  # one byte past the most: too long
        found = await self._bounded(
            "response_owner",  # the op's name as before it carried the chain too
            pipe.execute(raise_on_error=False),
            unanswered=_UNANSWERED,
            keys=(key, chain_key),
        )
        if found is _UNANSWERED:
            raise SharedStateUnavailable("where this response is stored could not be read")
        if found is _WRONG_TYPE:  # as a pipeline raising at once would say it (repaired)
            return None, None
        owner_value, chain_value = found
        wrong = [k for k, v in ((key, owner_value), (chain_key, chain_value)) if is_wrong_type(v)]
        if wrong and self._repairs is not None:
            self._in_background(self._repairs.repair(wrong))
        return self._owner(owner_value), self._chain(chain_value)

    def _owner(self, value: Any) -> Owner | None:
        if not isinstance(value, bytes) or not value:  # none written (or not a string)
            return None
        owner = Owner.decode(value.decode("utf-8", errors="replace"))
        if owner is None or len(value) > MAX_OWNER_BYTES:
            if self._bad is not None:
                self._bad.skipped("owner", value[:64])
            return None
        return owner

    def _chain(self, value: Any) -> StoredChain | None:
        if not isinstance(value, bytes) or not value:  # none written (or not a string)
            return None
        chain = StoredChain.decode(value)
        if chain is None and self._bad is not None:
            self._bad.skipped("chain", value[:64])
        return chain

    def withdraw(self, worker: str, hashes: Sequence[int]) -> None:
        """The dispatch failed: its reservation goes, without holding the request up."""
        if not hashes or not self._peers():
            return
        pending = self._reserving.get(_reservation(worker, hashes))
        key, members = self._keys.reserved(worker), [member(h) for h in hashes]
        self._in_background(_after(pending, lambda: self._redis.zrem(key, *members)))

    def _in_background(self, call: Coroutine[Any, Any, Any]) -> None:
        """``call`` off the request's path, within ``WITHDRAW_TIMEOUT_S``; its Redis
        errors are the sync loops' to notice. Past ``MAX_LATE_WRITES`` waiting (Redis
        not keeping up) it is dropped: a reservation it would withdraw lapses by itself."""
        if len(self._background) >= MAX_LATE_WRITES:
            call.close()
            self._metrics.operations.labels("background", "dropped").inc()
            return
        task = asyncio.create_task(self._quietly(call))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def _worker_keys(self, worker: str) -> tuple[str, str]:
        return self._keys.residency(worker), self._keys.reserved(worker)

    async def _bounded(
        self,
        op: str,
        call: Awaitable[Any],
        count_ok: bool = True,
        finish_late: bool = False,
        unanswered: Any = None,
        keys: Sequence[Any] = (),
    ) -> Any:
        """``call``'s result, or ``unanswered`` past the bound or on a Redis error
        (counted). The wait is observed whatever the result: a slow Redis shows as the
        bound.

        ``finish_late``: a write past the bound still completes, off the request's path.
        Cancelling it would leave a reservation claiming blocks for its whole lapse after
        the request ended, or a turn unrecorded, and makes redis-py drop the connection
        (a busy machine would then churn connections on every slow round trip)."""
        started = time.perf_counter()
        task = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait({task}, timeout=self._timeout_s)
        except asyncio.CancelledError:
            self._give_up(op, task, finish_late)
            raise
        finally:
            self._metrics.seconds.labels(op).observe(time.perf_counter() - started)
        if not done:
            self._metrics.operations.labels(op, "timeout").inc()
            self._give_up(op, task, finish_late)
            return unanswered
        error = task.exception()
        if is_wrong_type(error) and keys and self._repairs is not None:
            self._metrics.operations.labels(op, "error").inc()
            self._in_background(self._repairs.repair(keys))
            return _WRONG_TYPE if unanswered is _UNANSWERED else unanswered
        if isinstance(error, REDIS_ERRORS):
            self._metrics.operations.labels(op, "error").inc()
            return unanswered
        if error is not None:
            raise error
        if count_ok:
            self._metrics.operations.labels(op, "ok").inc()
        return task.result()

    def _give_up(self, op: str, task: asyncio.Future[Any], finish_late: bool) -> None:
        """The request stops waiting for ``task``; a write goes on without it while
        there is room (Redis not keeping up: dropped)."""
        if not finish_late or len(self._background) >= MAX_LATE_WRITES:
            task.cancel()
            # It may have failed meanwhile (cancel() cannot undo that): retrieved, or
            # asyncio logs "Task exception was never retrieved" with Redis's error.
            task.add_done_callback(_retrieved)
            return
        self._background.add(task)
        task.add_done_callback(functools.partial(self._finished_late, op))

    def _finished_late(self, op: str, task: asyncio.Future[Any]) -> None:
        self._background.discard(task)
        # A late write's error is retrieved here and left to the sync loops to notice.
        if not task.cancelled() and task.exception() is None:
            self._metrics.operations.labels(op, "late").inc()

    async def _quietly(self, call: Awaitable[Any]) -> None:
        with contextlib.suppress(*REDIS_ERRORS):
            async with asyncio.timeout(WITHDRAW_TIMEOUT_S):
                await call


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _reservation(worker: str, hashes: Sequence[int]) -> tuple[str, int, int, int]:
    """A dispatch's reservation, as far as telling it from others matters (two prompts
    alike in these are siblings: one waiting on the other's write costs nothing)."""
    return worker, len(hashes), hashes[0], hashes[-1]


async def _after(first: asyncio.Future[Any] | None, then: Callable[[], Awaitable[Any]]) -> Any:
    """``then()``, once ``first`` (if any) has landed or failed: Redis applies them in
    that order."""
    if first is not None and not first.done():
        await asyncio.wait({first})
    return await then()
