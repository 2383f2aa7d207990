"""The server the router runs on: ``RouterRunner`` serves the aiohttp app with a
``FrontConnection`` (router.front) for every client connection, which serves the two
completion routes itself and hands everything else to the app (router.bridge).

aiohttp refuses HTTP its parser cannot read with a plain-text 400 and logs each at ERROR
with a traceback. The front refuses malformed HTTP before aiohttp sees it, as JSON; what
aiohttp still refuses itself is JSON too (``bridge.JsonRefusals``), and
``MALFORMED_HTTP_FILTER`` keeps those refusals out of the log unless ``aiohttp.server``
logs at DEBUG: one client sending garbage would otherwise fill it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from router.bridge import Bridge
from router.front import FrontConnection
from router.state import STATE_KEY

# The bridged handler never closes an idle connection itself: the front times it out.
_BRIDGE_KEEPALIVE_S = 10.0 * 365 * 86400


class _MalformedHttpFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is None or not isinstance(record.exc_info[1], HttpProcessingError):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.msg = f"{record.msg}: {record.exc_info[1]!r}"
        record.exc_info = None
        return True


MALFORMED_HTTP_FILTER = _MalformedHttpFilter()


class _FrontServer(web.Server):
    """aiohttp's server, making a ``FrontConnection`` for each client connection."""

    def __init__(self, app: web.Application, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._app = app
        self._fronts: set[FrontConnection] = set()

    def __call__(self) -> FrontConnection:  # type: ignore[override]
        front = FrontConnection(self._app.get(STATE_KEY), self._bridge, self._fronts.discard)
        self._fronts.add(front)
        return front

    def _bridge(self, responded: Callable[[bool], None]) -> Bridge:
        kwargs = {**self._kwargs, "keepalive_timeout": _BRIDGE_KEEPALIVE_S}
        return Bridge(self, responded, **kwargs)

    def pre_shutdown(self) -> None:
        for front in self._fronts:
            front.close()
        super().pre_shutdown()

    async def shutdown(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        await asyncio.gather(*(front.shutdown(timeout) for front in list(self._fronts)))
        await super().shutdown(timeout)


class RouterRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are the router's own (router.front)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        kwargs: dict[str, Any] = dict(server._kwargs)
        return _FrontServer(
            self.app,
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,
            **kwargs,
        )
