"""Warnings that someone outside the router can cause at any rate (an engine's malformed
KV events, say): each logged the first time, then at most once every ``every_s`` per
key, with how many went unlogged meanwhile. Their metrics count every one; the log must
not grow with whatever a worker chooses to send."""

from __future__ import annotations

import logging
from collections.abc import Hashable

from router.clock import monotonic

EVERY_S = 60.0


class SparseLog:
    def __init__(self, logger: logging.Logger, every_s: float = EVERY_S) -> None:
        self._logger = logger
        self._every_s = every_s
        self._state: dict[Hashable, tuple[float, int]] = {}  # key: (logged at, unlogged)

    def warning(self, key: Hashable, message: str, *args: object) -> None:
        now = monotonic()
        logged_at, unlogged = self._state.get(key, (float("-inf"), 0))
        if now - logged_at < self._every_s:
            self._state[key] = (logged_at, unlogged + 1)
            return
        self._state[key] = (now, 0)
        if unlogged:
            message += " (and %d more like it since the last)"
            args = (*args, unlogged)
        self._logger.warning(message, *args)
