"""An engine's KV event publisher under the test's control: vLLM's wire (PUB of
``(topic, seq, payload)``, a ROUTER replaying kept batches then ``seq = -1``), but the
test decides which batches the live stream loses, how far back the replay reaches, and
when the sequence starts again (a new engine process)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import zmq
import zmq.asyncio

from bench.ports import free_port
from bench.sim.kv_events import BlockRemoved, BlockStored, EventBatch, KVEventsConfig
from router.config import KvEventsEndpoints
from router.index.prefix import chain_seed, prefix_key
from router.wire.blocks import token_bytes
from tests.conftest import EngineFactory, RunningEngine
from tests.engine_kv_events import encode

BLOCK = 16  # tokens a block, as vLLM's default
END = (-1).to_bytes(8, "big", signed=True)


def tokens(session: int, blocks: int) -> list[int]:
    return [session * 100_000 + i for i in range(blocks * BLOCK)]


def router_hashes(ids: Sequence[int], model: str = "m", salt: str | None = None) -> list[int]:
    """What a request for these tokens is keyed by (prefix.tokenizer, 64-byte blocks)."""
    return list(prefix_key(token_bytes(ids), 4 * BLOCK, chain_seed(model, salt)).hashes)


def stored(
    ids: Sequence[int], first: int, parent: int | None, block_size: int = BLOCK
) -> BlockStored:
    """Blocks of ``ids`` announced with engine hashes ``first``, ``first + 1``, ..."""
    count = len(ids) // block_size
    return BlockStored(
        block_hashes=list(range(first, first + count)),
        parent_block_hash=parent,
        token_ids=list(ids),
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def removed(*engine_hashes: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(engine_hashes), medium="GPU")


class ScriptedPublisher:
    def __init__(
        self, context: zmq.asyncio.Context, replay: bool = True, port: int | None = None
    ) -> None:
        self.port = port or free_port()
        self.replay_port = free_port()
        self._pub = context.socket(zmq.PUB)
        self._pub.bind(f"tcp://127.0.0.1:{self.port}")
        self._router = context.socket(zmq.ROUTER)
        if replay:
            self._router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.kept: list[tuple[int, bytes]] = []
        self.seq = 0
        self._task = asyncio.create_task(self._serve_replays()) if replay else None

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    async def publish(self, *events: Any, live: bool = True, payload: bytes | None = None) -> int:
        """One batch: kept for replays, and sent live unless ``live`` is False (lost)."""
        seq = self.seq
        self.seq += 1
        body = payload if payload is not None else encode(EventBatch(0.0, list(events), 0))
        self.kept.append((seq, body))
        if live:
            await self._pub.send_multipart((b"", seq.to_bytes(8, "big"), body))
        return seq

    def restart(self) -> None:
        """A new engine process: its sequence starts at 0 and it has kept nothing."""
        self.seq = 0
        self.kept.clear()

    def forget_before(self, seq: int) -> None:
        self.kept = [(s, p) for s, p in self.kept if s >= seq]

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self._router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, body in list(self.kept):
                if seq >= first:
                    await self._router.send_multipart(
                        (client, b"", b"", seq.to_bytes(8, "big"), body)
                    )
            await self._router.send_multipart((client, b"", b"", END, b""))

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(linger=0)
        self._router.close(linger=0)


@contextlib.asynccontextmanager
async def scripted_publisher(
    replay: bool = True, port: int | None = None
) -> AsyncIterator[ScriptedPublisher]:
    context = zmq.asyncio.Context()
    publisher = ScriptedPublisher(context, replay, port)
    try:
        yield publisher
    finally:
        await publisher.aclose()
        context.destroy(linger=0)


@contextlib.asynccontextmanager
async def publishing_engine(
    engine_factory: EngineFactory, **overrides: Any
) -> AsyncIterator[tuple[RunningEngine, KvEventsEndpoints]]:
    """A simulated engine started with vLLM's --kv-events-config on free ports."""
    port, replay = free_port(), free_port()
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay}",
    )
    async with engine_factory(kv_events=events, **overrides) as engine:
        yield engine, KvEventsEndpoints(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
