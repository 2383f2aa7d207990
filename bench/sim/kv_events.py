"""KV events published as vLLM 0.33 publishes them (``vllm/distributed/kv_events.py``,
``vllm/config/kv_events.py``).

* The event types are vLLM's msgspec Structs: a batch is the array ``[ts, events,
  data_parallel_rank]``, each event a map tagged ``type``, defaults omitted.
* ``ZmqEventPublisher``: a thread owns a PUB socket (bound for ``*``, ``::``, ipc and
  inproc endpoints, connected otherwise) and sends ``(topic, seq as 8 bytes big-endian,
  payload)``; the last ``buffer_steps`` payloads are kept for a ROUTER replay socket,
  which answers ``[identity, "", start_seq]`` with every kept batch from ``start_seq``
  on and then ``("", -1, "")``. Ports move up by the data-parallel rank.
* ``KVEventsConfig.from_cli``: ``--kv-events-config '<json>'`` with vLLM's field names.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass, fields
from itertools import count
from typing import Any, Protocol

import msgspec
import orjson
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"unknown event publisher {self.publisher!r}")
        if self.buffer_steps < 1 or self.hwm < 0 or self.max_queue_size < 1:
            raise ValueError("buffer_steps and max_queue_size must be >= 1, hwm >= 0")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def open_publisher(self, data_parallel_rank: int = 0) -> ZmqEventPublisher:
        return ZmqEventPublisher(self, data_parallel_rank)

    @classmethod
    def from_cli(cls, text: str) -> KVEventsConfig:
        raw = orjson.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config is a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown --kv-events-config fields: {', '.join(unknown)}")
        return cls(**raw)


END_SEQ = (-1).to_bytes(8, "big", signed=True)
SHUTDOWN_TIMEOUT_S = 1.0


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's port offset for a data-parallel rank (a port of 0 is left to the OS)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        if not base or int(port) == 0:
            return endpoint
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class PublisherSettings(Protocol):
    """The fields a publisher reads: vLLM's ``KVEventsConfig`` and SGLang's
    (``bench/sim/sglang_kv_events.py``) both have them."""

    @property
    def endpoint(self) -> str: ...
    @property
    def replay_endpoint(self) -> str | None: ...
    @property
    def buffer_steps(self) -> int: ...
    @property
    def hwm(self) -> int: ...
    @property
    def max_queue_size(self) -> int: ...
    @property
    def topic(self) -> str: ...


class ZmqEventPublisher:
    """vLLM's; SGLang's differs only in how a batch is stamped with its rank and when the
    PUB socket binds (``_stamp_rank``, ``_binds``)."""

    def __init__(self, config: PublisherSettings, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank) or ""
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        self._queue: queue.Queue[msgspec.Struct | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._seq = count()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(config.hwm)
            if self._binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError:
            # A port taken: close what was opened, so that it can be tried again.
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="sim-kv-events")
        self._thread.start()

    def publish(self, batch: msgspec.Struct) -> None:
        if not self._running:
            raise RuntimeError("Publisher is closed")
        self._stamp_rank(batch)
        self._queue.put(batch)

    def _stamp_rank(self, batch: msgspec.Struct) -> None:
        if isinstance(batch, EventBatch) and batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank

    def _binds(self, endpoint: str) -> bool:
        return _binds(endpoint)

    def shutdown(self) -> None:
        self._running = False
        self._queue.put_nowait(None)
        self._thread.join(timeout=SHUTDOWN_TIMEOUT_S)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while self._running or self._queue.qsize() > 0:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                break
            seq = next(self._seq)
            payload = encoder.encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return  # vLLM logs and ignores it
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
