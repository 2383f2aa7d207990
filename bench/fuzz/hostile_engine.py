"""An engine that answers what it is told to: the hostile side of ``kvrouter bench fuzz
--side engine``.

It speaks just enough HTTP to be put in a router's fleet (``/health`` answers 200,
``/v1/models`` lists its model), then answers every forwarded request, and every scrape
of ``/metrics``, with the bytes of the current case (``bench.fuzz.engine_inputs``),
written piece by piece, and ends the connection as the case says. Its KV events go out
on vLLM's wire (a PUB socket, a ROUTER replaying what it kept), with the case's frames:
the sequence frame is the next number unless the case bends it.

The fuzz driver runs it in a process of its own (``bench.fuzz.hostile_process``) and adds
cases there (``set_numbered``), several at once, told apart by a number in the request
(``case_marker``), which every API's conversion to chat keeps: a forwarded request
carrying one gets that case's answer; a request with none gets ``case``'s (a test sets
it). A case's KV messages are published before ``set_numbered`` returns, and its metrics
page is what the next scrapes get.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections import deque
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import orjson
import zmq
import zmq.asyncio

from bench.fuzz.engine_inputs import SILENT_S, EngineCase, Reply
from bench.ports import free_port

MAX_REQUEST_HEAD = 64 * 1024
_MARKED = re.compile(rb"fuzz-case-(\d+)-")
KEPT_MESSAGES = 64  # what the replay endpoint answers with
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_OK_EMPTY = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
_DEFAULT_METRICS = Reply(
    (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 40\r\n\r\n"
        b"vllm:num_requests_running 0\nvllm:xx 1\n\n",
    )
)


class HostileEngine:
    def __init__(self, model: str) -> None:
        self.model = model
        self.case: EngineCase | None = None
        self.numbered: dict[int, EngineCase] = {}  # cases played at once, by number
        self.replies_sent = 0  # forwarded requests answered with a case's reply
        self.scrapes = 0
        self.published = 0
        self.replays = 0
        self.port = free_port()
        self.kv_port, self.replay_port = free_port(), free_port()
        self._server: asyncio.Server | None = None
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._replay = self._context.socket(zmq.ROUTER)
        self._seq = 0
        self._kept: deque[tuple[bytes, ...]] = deque(maxlen=KEPT_MESSAGES)
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    async def start(self) -> None:
        self._pub.bind(self.kv_endpoint)
        self._replay.bind(self.replay_endpoint)
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", self.port, limit=MAX_REQUEST_HEAD
        )
        self._spawn(self._serve_replays())

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        self._context.destroy(linger=0)

    def drop_case(self, number: int) -> None:
        self.numbered.pop(number, None)

    async def set_numbered(self, number: int, case: EngineCase) -> None:
        """The answer to requests marked ``number``; its metrics page the next scrapes',
        its KV messages sent."""
        self.numbered[number] = case
        self.case = EngineCase(case.reply, case.metrics)  # for the scrapes
        for frames in case.kv_messages:
            await self.publish(frames)

    async def publish(self, frames: tuple[bytes, ...]) -> None:
        seq = self._seq
        sent = tuple(self._seq_frame(frame, seq) for frame in frames)
        self._seq += 1
        self._kept.append(sent)
        self.published += 1
        await self._pub.send_multipart(sent)

    def _seq_frame(self, frame: bytes, seq: int) -> bytes:
        if frame == b"next":
            return seq.to_bytes(8, "big")
        if frame == b"jump":
            self._seq += 1000
            return (seq + 1000).to_bytes(8, "big")
        if frame == b"back":
            return max(0, seq - 5).to_bytes(8, "big")
        if frame == b"end":
            return END_OF_REPLAY
        if frame == b"short":
            return b"\x01"
        return frame

    async def _serve_replays(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            self.replays += 1
            client = frames[0]
            for kept in list(self._kept):
                await self._replay.send_multipart((client, b"", *kept))
            await self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- HTTP ----------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.transport.abort()
            if task is not None:
                self._tasks.discard(task)

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """One request and its answer; False when the connection is done."""
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *header_lines = head.split(b"\r\n")
        method, target = request_line.split(b" ")[:2]
        length = 0
        for line in header_lines:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = await reader.readexactly(length) if length else b""
        path = target.split(b"?")[0]
        if method == b"GET" and path == b"/health":
            writer.write(_OK_EMPTY)
            return True
        if method == b"GET" and path == b"/v1/models":
            writer.write(self._models())
            return True
        case = self.case
        if method == b"GET" and path == b"/metrics":
            self.scrapes += 1
            metrics = case.metrics if case is not None and case.metrics else _DEFAULT_METRICS
            return await _play(metrics, writer)
        marked = _MARKED.search(body)
        if marked is not None:
            case = self.numbered.get(int(marked.group(1)))
        if method != b"POST" or case is None:
            writer.write(_NOT_FOUND)
            return True
        self.replies_sent += 1
        return await _play(case.reply, writer)

    def _models(self) -> bytes:
        body = orjson.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]})
        return (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % len(body)
            + body
        )


def case_marker(number: int) -> str:
    """What a request's text carries to name the case it is answered with."""
    return f"fuzz-case-{number}-"


async def _play(reply: Reply, writer: asyncio.StreamWriter) -> bool:
    """Write ``reply``; True when the connection stays open for another request."""
    for i, piece in enumerate(reply.pieces):
        if i and reply.pause_s:
            await asyncio.sleep(reply.pause_s)
        writer.write(piece)
        await writer.drain()
    if reply.end == "keep":
        return True
    if reply.end == "silent":
        await asyncio.sleep(SILENT_S)
    elif reply.end == "reset":
        sock = writer.get_extra_info("socket")
        if sock is not None:  # RST rather than FIN
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
    return False


@contextlib.asynccontextmanager
async def hostile_engine(model: str) -> AsyncIterator[HostileEngine]:
    engine = HostileEngine(model)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.aclose()
