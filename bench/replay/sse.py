"""Server-sent events read line by line from an aiohttp response body."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp


@dataclass(frozen=True, slots=True)
class SseEvent:
    event: str  # "message" unless the server named it
    data: str


async def iter_sse(content: aiohttp.StreamReader) -> AsyncIterator[SseEvent]:
    """Events of an SSE stream in order; a blank line ends each event.

    Comments and fields other than ``event`` and ``data`` are skipped. An event the
    stream ends in the middle of is still delivered, since some servers omit the last
    blank line.
    """
    event = "message"
    data: list[str] = []
    async for raw in content:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if data:
                yield SseEvent(event, "\n".join(data))
            event, data = "message", []
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            data.append(value)
        elif field == "event":
            event = value
    if data:
        yield SseEvent(event, "\n".join(data))
