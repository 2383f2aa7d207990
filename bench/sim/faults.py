"""Faults a test can switch on in a running simulated engine.

* ``fail_requests``: completions answer ``fail_status`` (default 500) with an error body.
* ``stall``: the engine stops making progress (a hung GPU): requests in flight and new
  ones get no tokens until the stall is lifted. ``/health`` stalls too.
* ``fail_health``: ``/health`` answers 503 while completions still work.
* ``fail_metrics``: ``/metrics`` answers 503 (a scrape that breaks; the load is unknown).
* ``hold_stream_end``: a stream sends its terminal event and holds the end of its body
  until the fault is lifted. vLLM's uvicorn writes the body's end after the last event, on
  its own; a client may close in between, and this makes that gap as long as a test needs.

A restart with an empty cache is ``Engine.restart``; it is exposed beside these at
``POST /sim/restart``. ``GET /sim/requests`` lists the engine's last requests with the
cached prefix each had when it arrived and when it was scheduled (``X-Request-Id``,
``prompt_tokens``, ``cached_at_arrival``, ``cached_at_schedule``, ``loaded``,
``arrived``, ``scheduled``, ``first_token``; ``bench/sim/request_log.py``), so a
benchmark can tell a router's wrong guess from blocks evicted while the request queued;
a restart empties it.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(slots=True)
class FaultState:
    fail_requests: bool = False
    fail_status: int = 500
    stall: bool = False
    fail_health: bool = False
    fail_metrics: bool = False
    hold_stream_end: bool = False


class Faults:
    def __init__(self) -> None:
        self.state = FaultState()
        self._running = asyncio.Event()
        self._running.set()
        self._stream_end = asyncio.Event()
        self._stream_end.set()

    def update(self, changes: dict[str, Any]) -> FaultState:
        """Apply a partial update; unknown keys or wrong types raise ``ValueError``."""
        known = asdict(self.state)
        for key, value in changes.items():
            if key not in known:
                raise ValueError(f"unknown fault {key!r}; known: {', '.join(known)}")
            if type(value) is not type(known[key]):
                raise ValueError(f"fault {key!r} must be a {type(known[key]).__name__}")
        if not 400 <= int(changes.get("fail_status", self.state.fail_status)) <= 599:
            raise ValueError("fail_status must be an HTTP error status (400-599)")
        for key, value in changes.items():
            setattr(self.state, key, value)
        for flag, event in (
            (not self.state.stall, self._running),
            (not self.state.hold_stream_end, self._stream_end),
        ):
            if flag:
                event.set()
            else:
                event.clear()
        return self.state

    def as_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    async def wait_unstalled(self) -> None:
        await self._running.wait()

    async def stream_end_released(self) -> None:
        await self._stream_end.wait()
