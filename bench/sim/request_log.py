"""What the engine knew about each request's cached prefix: ``GET /sim/requests``.

A router predicts how much of a request's prompt an engine holds; the engine reports
what it reused in ``usage.prompt_tokens_details.cached_tokens``. When the two differ,
either the router did not know what the engine held when the request arrived, or the
engine held it then and evicted some of it while the request waited in its queue (the
prefills ahead of it took the blocks). Only the engine can tell these apart, so it keeps
one record per request:

* ``request_id``: the client's ``X-Request-Id`` header as given (vLLM's
  ``OpenAIServing._base_request_id`` makes it the base of the request id:
  ``chatcmpl-<header>``, ``cmpl-<header>``); null when absent.
* ``prompt_tokens``.
* ``cached_at_arrival``: the prompt tokens the block pool held as a cached prefix when the
  request was submitted, by the rule the scheduler admits with
  (``Scheduler.prefix_hit``).
* ``cached_at_schedule``: what it was admitted with when first scheduled, the usage's
  ``cached_tokens``; null while it has not been.
* ``loaded``: of ``cached_at_schedule``, the tokens read back from the offload tier
  (``bench/sim/offload.py``; 0 without one).
* ``arrived``, ``scheduled``, ``first_token``: those moments on the engine's simulated
  clock (seconds; null until they happen).

``GET /sim/requests`` answers ``{"requests": [...]}``, the last ``MAX_REQUEST_RECORDS``
in the order they arrived; ``POST /sim/restart`` empties it, as a new process would.
"""

from __future__ import annotations

from collections import deque
from typing import Any

# Records kept; an older one is dropped as a new request arrives.
MAX_REQUEST_RECORDS = 10_000


class RequestRecord:
    """One request's cache facts; ``scheduled`` fills in the second half."""

    __slots__ = (
        "arrived",
        "cached_at_arrival",
        "cached_at_schedule",
        "first_token_at",
        "loaded",
        "prompt_tokens",
        "request_id",
        "scheduled_at",
    )

    def __init__(
        self, request_id: str | None, prompt_tokens: int, cached_at_arrival: int, arrived: float
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.cached_at_arrival = cached_at_arrival
        self.arrived = arrived
        self.cached_at_schedule: int | None = None
        self.scheduled_at: float | None = None
        self.loaded = 0
        self.first_token_at: float | None = None

    def scheduled(self, cached_tokens: int, at: float, loaded: int = 0) -> None:
        self.cached_at_schedule = cached_tokens
        self.scheduled_at = at
        self.loaded = loaded

    def as_dict(self) -> dict[str, Any]:
        request_id = self.request_id
        if request_id is not None and not request_id.isascii():
            # Header bytes that are not UTF-8 arrive as surrogates, which JSON cannot carry.
            request_id = request_id.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        return {
            "request_id": request_id,
            "prompt_tokens": self.prompt_tokens,
            "cached_at_arrival": self.cached_at_arrival,
            "cached_at_schedule": self.cached_at_schedule,
            "loaded": self.loaded,
            "arrived": self.arrived,
            "scheduled": self.scheduled_at,
            "first_token": self.first_token_at,
        }


class RequestLog:
    """The last ``limit`` records, oldest first."""

    __slots__ = ("_records",)

    def __init__(self, limit: int = MAX_REQUEST_RECORDS) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=limit)

    def add(self, record: RequestRecord) -> None:
        self._records.append(record)

    def clear(self) -> None:
        self._records.clear()

    def as_dict(self) -> dict[str, Any]:
        return {"requests": [record.as_dict() for record in self._records]}
