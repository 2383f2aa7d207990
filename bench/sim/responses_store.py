"""The stored responses of vLLM 0.32's Responses API, as 0.34's (simulated): what ``GET
/v1/responses/{id}``, ``cancel`` and ``previous_response_id`` read
(``docs/engines/vllm-messages-responses.md`` §2.5).

vLLM keeps them only with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` (off by default; the
simulator's ``EngineConfig.responses_store``), in two dicts per API-server process
(``response_store`` and ``msg_store``) that are **never evicted**: a server that answers
stored requests for long enough grows until it runs out of memory. A simulator runs
for hours of benchmark traffic, so this store holds at most ``max_entries`` responses
and forgets the oldest first (insertion order; reading one does not make it younger).
A ``previous_response_id`` that names a forgotten response is a 404, as an unknown one.

Each entry keeps the chat messages its request rendered to, the earlier turns
included; a turn's list shares the message dicts of the turn before it, so a
conversation of n turns costs n lists of references, not n copies of its text.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_ENTRIES = 10_000


@dataclass(slots=True)
class StoredResponse:
    """One response as the POST answered it, and the chat messages that prompted it."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponseStore:
    """Responses by id, at most ``max_entries`` of them (the oldest forgotten first)."""

    __slots__ = ("_entries", "max_entries")

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, rid: str) -> StoredResponse | None:
        return self._entries.get(rid)

    def put(self, rid: str, stored: StoredResponse) -> None:
        """Keep ``stored`` as ``rid`` (replacing one of that id, which becomes the
        youngest); forget the oldest past ``max_entries``."""
        self._entries.pop(rid, None)
        self._entries[rid] = stored
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
