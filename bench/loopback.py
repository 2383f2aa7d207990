"""Serve an aiohttp app on a free loopback port (tests and in-process benchmarks)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

SHUTDOWN_TIMEOUT_S = 5.0


@contextlib.asynccontextmanager
async def serve_on_loopback(
    app: web.Application, port: int = 0, runner_class: type[web.AppRunner] = web.AppRunner
) -> AsyncIterator[str]:
    """Run ``app`` on 127.0.0.1 and ``port`` (0: a free one); yields its base URL; stops
    it on exit."""
    # A short graceful shutdown: a test that leaves a stream open should not wait 60 s.
    runner = runner_class(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
