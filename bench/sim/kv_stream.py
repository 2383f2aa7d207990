"""One engine's KV event publisher, restartable as a new vLLM process restarts it.

A vLLM process that starts again starts a new ``ZmqEventPublisher`` on the same
endpoints: its sequence numbers begin again at 0, and its replay buffer holds only what
the new process published. ``KVEventStream.restart`` does that for a simulated restart
(``POST /sim/restart``): the old publisher is shut down, a new one binds the same
endpoints. The simulated engine keeps serving meanwhile, so batches published during the
swap wait for the new publisher (at most ``max_queue_size`` of them; past that they are
dropped, as a full queue would not take them either) and go out as its first.

The swap runs as a task of its own, shielded from the caller: a client that hangs up on
``/sim/restart`` does not leave the stream half-swapped. ``close`` waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import msgspec
import zmq

from bench.sim.kv_events import ZmqEventPublisher

log = logging.getLogger(__name__)

# A closed socket's port is released by ZMQ's I/O thread a moment later: binding it again
# is retried for this long.
REBIND_TIMEOUT_S = 5.0
REBIND_INTERVAL_S = 0.02


class StreamConfig(Protocol):
    """vLLM's ``KVEventsConfig`` or SGLang's: each opens its engine's publisher."""

    @property
    def max_queue_size(self) -> int: ...
    def open_publisher(self, data_parallel_rank: int = 0) -> ZmqEventPublisher: ...


class KVEventStream:
    """``kv_event_log.BatchSink`` (or SGLang's) over a restartable publisher."""

    def __init__(self, config: StreamConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._publisher: ZmqEventPublisher | None = config.open_publisher(data_parallel_rank)
        self._held: list[msgspec.Struct] | None = None  # batches published during a swap
        self._swap: asyncio.Task[None] | None = None
        self._closed = False

    def publish(self, batch: msgspec.Struct) -> None:
        if self._held is not None:
            if len(self._held) < self.config.max_queue_size:
                self._held.append(batch)
        elif self._publisher is not None:
            self._publisher.publish(batch)

    async def restart(self) -> None:
        """Shut the publisher down and start a new one on the same endpoints."""
        if self._swap is None or self._swap.done():
            self._swap = asyncio.create_task(self._restart(), name="sim-kv-events-restart")
        await asyncio.shield(self._swap)

    async def close(self) -> None:
        self._closed = True
        if self._swap is not None:
            await asyncio.gather(self._swap, return_exceptions=True)
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            await asyncio.to_thread(publisher.shutdown)

    async def _restart(self) -> None:
        self._held = []
        try:
            old, self._publisher = self._publisher, None
            if old is not None:
                await asyncio.to_thread(old.shutdown)
            if not self._closed:
                self._publisher = await asyncio.to_thread(self._bind_again)
        finally:
            held, self._held = self._held, None
        if self._publisher is None:
            log.error("KV events stopped: the publisher could not bind its endpoints again")
            return
        for batch in held:
            self._publisher.publish(batch)

    def _bind_again(self) -> ZmqEventPublisher | None:
        deadline = time.monotonic() + REBIND_TIMEOUT_S
        while True:
            try:
                return self.config.open_publisher(self.data_parallel_rank)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    log.error("KV event publisher: %s", exc)
                    return None
                time.sleep(REBIND_INTERVAL_S)
