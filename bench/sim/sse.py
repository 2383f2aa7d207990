"""A streamed completion: the server-sent events vLLM sends for it, written as the
engine publishes tokens (through an ``exchange.Stream``, of either front-end)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Protocol

from bench.sim.faults import Faults
from bench.sim.openai_api import (
    ChunkEvents,
    ParsedRequest,
    call_arguments,
    call_arguments_head,
    call_chunk,
    call_finish_reason,
    new_id,
    sse_event,
    stream_chunk,
    tool_call_id,
    usage,
    usage_chunk,
)
from bench.sim.request import SimRequest

if TYPE_CHECKING:
    from bench.sim.exchange import Exchange, Stream

STREAM_HEADERS: tuple[tuple[str, str], ...] = (
    ("Content-Type", "text/event-stream; charset=utf-8"),
    ("Cache-Control", "no-cache"),
)


class Events(Protocol):
    """A stream's events (a completion's chunks, a message's events), handed out as its
    request advances."""

    def due(self, sim: SimRequest) -> bytes:
        """The events since the last call; once ``sim`` finished, the last of them."""


class StreamEvents:
    """The SSE events of one streamed completion, handed out as the request advances.
    The events due at one time go out in one write: the same bytes in fewer syscalls
    (the role chunk with the first text, the last text with the usage and [DONE])."""

    __slots__ = (
        "_block_tokens",
        "_call_id",
        "_chunks",
        "_created",
        "_parsed",
        "_rid",
        "_started",
        "sent",
    )

    def __init__(self, parsed: ParsedRequest, block_tokens: int) -> None:
        self._parsed = parsed
        self._block_tokens = block_tokens
        self._rid, self._created = new_id(parsed.kind), int(time.time())
        self._chunks = ChunkEvents(parsed.kind, self._rid, parsed.model, self._created)
        self._started = False
        self._call_id = tool_call_id()  # a reply that calls a function (parsed.calls)
        self.sent = 0  # output tokens already handed out

    def due(self, sim: SimRequest) -> bytes:
        """The events since the last call; at the end, the last of them."""
        parsed, rid, created = self._parsed, self._rid, self._created
        kind, model = parsed.kind, parsed.model
        events: list[bytes] = []
        if not self._started:
            self._started = True
            if kind == "chat":
                # As vLLM: the role chunk goes out with the first token, after the prefill.
                role = stream_chunk(kind, rid, model, created, "", None, first=True)
                events.append(sse_event(role))
        if parsed.calls is not None:
            events.extend(self._call_events(sim))
        elif sim.output_tokens > self.sent:
            finish = sim.finish_reason if sim.finished else None
            events.append(self._chunks.text(sim.output_text(self.sent), finish))
            self.sent = sim.output_tokens
        if sim.finished:
            if parsed.include_usage:
                usage_body = usage(
                    kind,
                    True,
                    sim.prompt_tokens,
                    sim.output_tokens,
                    sim.cached_tokens,
                    sim.cache_written_tokens(self._block_tokens),
                )
                chunk = usage_chunk(kind, rid, model, created, usage_body, parsed.fingerprint)
                events.append(sse_event(chunk))
            events.append(b"data: [DONE]\n\n")
        return b"".join(events)

    def _call_events(self, sim: SimRequest) -> list[bytes]:
        """A reply that calls ``parsed.calls``: its text streamed as the arguments."""
        parsed, rid, created = self._parsed, self._rid, self._created
        assert parsed.calls is not None
        events = []
        if sim.output_tokens > self.sent:
            piece = call_arguments(sim.output_text(self.sent))
            if self.sent == 0:
                head = (self._call_id, parsed.calls)
                events.append(sse_event(call_chunk(rid, parsed.model, created, None, None, head)))
                piece = call_arguments_head() + piece
            events.append(sse_event(call_chunk(rid, parsed.model, created, piece, None)))
            self.sent = sim.output_tokens
        if sim.finished:
            finish = call_finish_reason(parsed.calls_named, sim.finish_reason or "length")
            end = call_chunk(rid, parsed.model, created, '"}', finish)
            events.append(sse_event(end))
        return events


async def stream_completion(
    exchange: Exchange, parsed: ParsedRequest, sim: SimRequest, faults: Faults, block_tokens: int
) -> Stream:
    """Answer a ``"stream": true`` completion (``stream_events``)."""
    return await stream_events(exchange, StreamEvents(parsed, block_tokens), sim, faults)


async def stream_events(
    exchange: Exchange, events: Events, sim: SimRequest, faults: Faults
) -> Stream:
    """Answer with a stream: the head, then ``events`` as the engine publishes tokens,
    then the last of them, then the end of the body in a write of its own, as vLLM's
    uvicorn sends it (held while the ``hold_stream_end`` fault is on);
    ``ConnectionResetError`` if it is dropped."""
    response = await exchange.stream(STREAM_HEADERS)
    # Where the front-end can write without awaiting, the engine's publish schedules a
    # callback that writes what is due, instead of waking this task for every chunk
    # (the wake-up cost as much CPU as the chunk). It runs when the task would have:
    # what the engine publishes before then goes out in one write, as before. The end,
    # a drop and a full socket buffer still take the loop below.
    loop = asyncio.get_running_loop()
    scheduled = False

    def flush() -> None:
        nonlocal scheduled
        scheduled = False
        if sim.finished:
            return  # the last events, or the drop, are the loop's
        if not response.ready():
            sim.updated.set()
            return
        data = events.due(sim)
        if data:
            response.write_nowait(data)

    def write_through(sim: SimRequest) -> bool:
        nonlocal scheduled
        if sim.finished or not response.ready():
            return False
        if not scheduled:
            scheduled = True
            loop.call_soon(flush)
        return True

    sim.listener = write_through
    while True:
        await sim.next_update()
        if sim.dropped:
            raise ConnectionResetError("engine restarted")
        data = events.due(sim)
        if sim.finished:
            break
        if data:
            await response.write(data)
    if data:
        await response.write(data)
    await faults.stream_end_released()
    await response.end(b"")
    return response
