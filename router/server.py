"""The router on its sockets: ``RouterServer`` runs the router's state, listens on TCP
(and, in a process group, a Unix socket), makes a ``ClientConnection`` for every
connection, and on exit stops taking connections, lets the requests in flight finish
for up to ``shutdown_timeout_s``, ends the rest, then stops the state."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import TracebackType

from router.app import routes_for, running_state
from router.config import RouterConfig
from router.edge.connection import ClientConnection
from router.edge.routes import Routes
from router.state import RouterState

# How long requests in flight may take to finish once the router is told to stop.
SHUTDOWN_TIMEOUT_S = 60.0


class RouterServer:
    def __init__(
        self, config: RouterConfig, shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S
    ) -> None:
        self.config = config
        self.routes: Routes = routes_for(config)
        self._shutdown_timeout_s = shutdown_timeout_s
        self._stack = contextlib.AsyncExitStack()
        self._state: RouterState | None = None
        self._servers: list[asyncio.Server] = []
        self._connections: set[ClientConnection] = set()

    @property
    def state(self) -> RouterState:
        if self._state is None:
            raise RuntimeError("the router is not running")
        return self._state

    async def __aenter__(self) -> RouterServer:
        self._state = await self._stack.enter_async_context(running_state(self.config))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.stop_serving()
        finally:
            await self._stack.aclose()
            self._state = None

    def _connection(self) -> ClientConnection:
        connection = ClientConnection(self.state, self.routes, self._connections.discard)
        self._connections.add(connection)
        return connection

    async def listen(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listens on ``host:port`` (port 0: a free one); returns the port."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            self._connection, host or None, port, reuse_port=reuse_port or None, backlog=1024
        )
        self._servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    async def listen_unix(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        self._servers.append(await loop.create_unix_server(self._connection, path))

    async def stop_serving(self) -> None:
        """No more connections; the requests in flight finish (or end after
        ``shutdown_timeout_s``). The state runs on until exit."""
        for server in self._servers:
            server.close()
        for connection in list(self._connections):
            connection.close()
        await asyncio.gather(
            *(c.shutdown(self._shutdown_timeout_s) for c in list(self._connections))
        )
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()


@contextlib.asynccontextmanager
async def serving(
    config: RouterConfig, host: str = "127.0.0.1", port: int = 0, shutdown_timeout_s: float = 5.0
) -> AsyncIterator[tuple[RouterServer, str]]:
    """A router listening on ``host:port`` (0: a free port), and its base URL; stopped on
    exit (tests and in-process benchmarks: a short graceful shutdown)."""
    async with RouterServer(config, shutdown_timeout_s) as server:
        bound = await server.listen(host, port)
        yield server, f"http://{host}:{bound}"
