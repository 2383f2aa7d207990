"""One data-parallel rank's KV events, read from its engine and applied in sequence.

A SUB socket reads the live stream; a DEALER asks the engine's replay endpoint (a
ROUTER: ``("", start_seq)`` in, every kept batch from ``start_seq`` then ``seq = -1``
out) for what the SUB did not deliver:

* on joining, for the engine's whole buffer (seq 0 on), before the live stream is read;
  live messages already replayed are skipped;
* on a gap in the live sequence, from the first missing seq.

A gap the replay cannot fill (no replay endpoint, no answer within ``replay_timeout_s``,
the engine no longer has the batches) drops what the rank announced: the router then
under-counts what the worker holds, and rebuilds from later events, never over-counts.
A live sequence that goes back means a new engine process (its sequence starts again):
likewise dropped. The worker turns exact at its first sign of life (a replay answered,
a batch received) and stays approximate if its blocks are not a whole number of the
router's (``router.index.engine_blocks``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from router.fleet.workers import Worker
from router.index.engine_blocks import block_size_advice
from router.index.events import (
    SEQ_BYTES,
    AllBlocksCleared,
    BlockStored,
    Event,
    MalformedEvents,
    Message,
    decode_batch,
    read_message,
)
from router.index.residency import LocalPrefixIndex
from router.kv_events.metrics import KvEventMetrics, ReplayResult, ResetReason
from router.kv_events.slices import event_slices
from router.observability.sparse_log import SparseLog

log = logging.getLogger(__name__)

# Live messages the SUB socket holds while the subscriber replays or is busy.
RECEIVE_HWM = 10_000
# One engine step's batch is well under a megabyte (its new blocks' token ids); a larger
# message drops the connection (the subscriber connects afresh and replays the gap), so
# a worker cannot make the router hold more than RECEIVE_HWM x this.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# A replay longer than this is not an engine's buffer (vLLM keeps 10,000 steps).
MAX_REPLAY_MESSAGES = 1_000_000
MODEL_POLL_S = 0.5
# Queued batches applied between yields to the loop (each is well under a millisecond).
YIELD_EVERY = 4
RECONNECT_S = 0.2


@dataclass(frozen=True, slots=True)
class RankEndpoints:
    rank: int
    endpoint: str
    replay_endpoint: str | None
    topic: bytes


@dataclass(frozen=True, slots=True)
class Exactness:
    """What makes a worker's residency exact: the router's block size (in tokens) and
    how long a request's blocks count as held before the engine announces them."""

    block_tokens: int
    speculative_ttl_s: float
    replay_timeout_s: float
    forecast_queue_evictions: bool = False


def _event_type(event: Event) -> str:
    """The event's ``type`` label (``router.kv_events.metrics.EVENT_TYPES``)."""
    if isinstance(event, AllBlocksCleared):
        return "cleared"
    kind = "stored" if isinstance(event, BlockStored) else "removed"
    return f"offload_{kind}" if event.offloaded else kind


class RankSubscriber:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        worker: Worker,
        endpoints: RankEndpoints,
        index: LocalPrefixIndex,
        exactness: Exactness,
        metrics: KvEventMetrics,
    ) -> None:
        self._context = context
        self._worker = worker
        self._endpoints = endpoints
        self._index = index
        self._exactness = exactness
        self._metrics = metrics
        self._model = ""
        self.next_seq: int | None = None  # the next batch to apply; None: any
        self._last_live: int | None = None
        self.rejected: str | None = None  # why the worker cannot be exact
        self._sparse = SparseLog(log)  # what the engine sends wrong, at whatever rate

    @property
    def rank(self) -> int:
        return self._endpoints.rank

    @property
    def _name(self) -> str:
        return self._worker.name

    async def run(self) -> None:
        self._model = await self._base_model()
        catch_up = self._endpoints.replay_endpoint is not None
        while True:
            await self._follow(catch_up)
            catch_up = False
            # The connection broke (and ZMQ will not reconnect after an oversized
            # message): a fresh one; what went by meanwhile is a gap, replayed.
            await asyncio.sleep(RECONNECT_S)

    async def _follow(self, catch_up: bool) -> None:
        """Read the live stream until its connection drops; ``catch_up``: first replay
        what the engine announced before (live messages queue in the SUB meanwhile)."""
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, self._endpoints.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        sub.connect(self._endpoints.endpoint)
        # The same socket read without a future per message (the handle stays sub's).
        queued: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        try:
            if catch_up:
                await self._replay(0)
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        self._sparse.warning(
                            "disconnected", "worker %s: KV event stream disconnected", self._name
                        )
                        return
                if sub in ready:
                    await self._drain(queued)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _drain(self, sub: zmq.Socket[bytes]) -> None:
        """Apply every message queued in the SUB; a burst must not hold the loop."""
        for count in itertools.count(1):
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            await self._live(frames)
            if count % YIELD_EVERY == 0:
                await asyncio.sleep(0)

    async def _base_model(self) -> str:
        """The model the engine's own blocks are keyed by (a LoRA's name its own)."""
        while True:
            worker = self._worker
            if worker.base_model is not None:
                return worker.base_model
            if len(worker.models) == 1:
                return next(iter(worker.models))
            await asyncio.sleep(MODEL_POLL_S)

    async def _live(self, frames: list[bytes]) -> None:
        try:
            message = read_message(frames)
        except MalformedEvents as exc:
            self._reset("malformed", str(exc))
            return
        seq = message.seq
        if self._last_live is not None and seq <= self._last_live:
            self._reset("restart", f"its sequence went back from {self._last_live} to {seq}")
            # A new process numbers from 0; batches before this one went by unread (a
            # subscription reaches a new publisher only with its first sends).
            self.next_seq = 0
        self._last_live = seq
        expected = self.next_seq
        if expected is not None and seq < expected:
            return  # replayed already
        if expected is not None and seq > expected:
            self._metrics.gaps.labels(self._name).inc()
            self._sparse.warning(
                "missed",
                "worker %s rank %d: KV events %d-%d missed",
                self._name,
                self._endpoints.rank,
                expected,
                seq - 1,
            )
            result = await self._replay(expected) if self._endpoints.replay_endpoint else "failed"
            if result == "failed":
                self._reset("gap", "the missed events could not be replayed")
            if self.next_seq is not None and seq < self.next_seq:
                return
        await self._apply(message)

    async def _replay(self, start: int) -> ReplayResult:
        """Ask the engine for its kept batches from ``start`` on and apply them."""
        assert self._endpoints.replay_endpoint is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        dealer.connect(self._endpoints.replay_endpoint)
        result: ReplayResult = "complete"
        try:
            await dealer.send_multipart((b"", start.to_bytes(SEQ_BYTES, "big")))
            for _ in range(MAX_REPLAY_MESSAGES):
                async with asyncio.timeout(self._exactness.replay_timeout_s):
                    frames = await dealer.recv_multipart()
                if len(frames) != 4 or frames[0]:
                    raise MalformedEvents("a replayed message is an empty frame and three more")
                message = read_message(frames[1:])
                if message.ends_replay:
                    self._become_exact()  # the engine answered: its publisher is there
                    break
                expected = self.next_seq
                if expected is not None and message.seq < expected:
                    continue
                if expected is not None and message.seq > expected:
                    result = "incomplete"  # rolled out of the engine's buffer
                    self._reset("gap", f"the engine no longer keeps events {expected} on")
                await self._apply(message)
            else:
                result = "failed"
        except (TimeoutError, MalformedEvents, zmq.ZMQError) as exc:
            self._sparse.warning("replay", "worker %s: KV event replay failed: %r", self._name, exc)
            result = "failed"
        finally:
            dealer.close(linger=0)
        self._metrics.replays.labels(self._name, result).inc()
        return result

    async def _apply(self, message: Message) -> None:
        self.next_seq = message.seq + 1
        try:
            batch = decode_batch(message.payload)
        except MalformedEvents as exc:
            self._reset("malformed", str(exc))
            return
        # The GPU's blocks (a CPU tier's may be chunks of several, or placeholders).
        stored = [e for e in batch.events if isinstance(e, BlockStored) and not e.offloaded]
        ours = self._exactness.block_tokens
        wrong = [e for e in stored if e.block_size % ours]
        if stored:
            self._worker.engine_block_tokens = stored[0].block_size
        if wrong:
            self._reject(wrong[0].block_size, sum(len(e.block_hashes) for e in wrong))
            return
        if self.rejected is not None:
            return
        self._become_exact()
        for i, piece in enumerate(event_slices(batch.events)):
            if i:
                await asyncio.sleep(0)  # a batch of many blocks must not hold the loop
            if not self._index.apply_events(self._name, self._endpoints.rank, piece):
                break  # no longer exact (the worker removed meanwhile)
        metrics = self._metrics
        metrics.batches.labels(self._name).inc()
        # The engine stamps a batch with its wall clock (vLLM: time.time()); a clock
        # that disagrees with ours shows as lag, never as a negative.
        metrics.lag.labels(self._name).observe(max(0.0, time.time() - batch.ts))
        counts: Counter[str] = Counter(_event_type(e) for e in batch.events)
        for kind, count in counts.items():
            metrics.events.labels(self._name, kind).inc(count)

    def _become_exact(self) -> None:
        if self.rejected is None and self._index.prefix_mode(self._name) != "exact":
            exactness = self._exactness
            self._index.make_exact(
                self._name,
                self._model,
                exactness.speculative_ttl_s,
                exactness.forecast_queue_evictions,
                exactness.block_tokens,
            )
            log.info("worker %s: exact prefix mode (its engine's KV events)", self._name)

    def _reject(self, block_size: int, blocks: int) -> None:
        self._metrics.rejected.labels(self._name).inc(blocks)
        if self.rejected is None:
            self.rejected = block_size_advice(block_size, self._exactness.block_tokens)
            log.error("worker %s stays approximate: %s", self._name, self.rejected)
            self._index.make_approximate(self._name)

    def _reset(self, reason: ResetReason, why: str) -> None:
        """Drop what this rank announced; later events rebuild it."""
        self._sparse.warning(
            ("reset", reason),
            "worker %s rank %d: dropping its announced blocks (%s: %s)",
            self._name,
            self._endpoints.rank,
            reason,
            why,
        )
        self._metrics.resets.labels(self._name, reason).inc()
        self._index.clear_rank(self._name, self._endpoints.rank)
        self.next_seq = None
