"""The hostile engine (``bench.fuzz.hostile_engine``) in a process of its own.

``python -m bench.fuzz.hostile_process MODEL CONTROL_SOCKET`` starts one, prints a JSON line
with its ports, and takes cases on a Unix socket (in a directory only this user can
enter: what comes over it is unpickled) until its stdin closes. In the fuzz harness's process
the engine shared the GIL with the case generator and the driver threads, which late in
a long run held it for seconds together (a probe there measured waits of 1-3.5 s): the
router's timeouts on the engine could not be told from the harness's own.

The control protocol is the harness talking to its own child: a request is
an 8-byte length and a pickled ``("add", number, case)``, ``("drop", number, None)`` or
``("counts", 0, None)``; the answer the same way, sent once the case is in place (its KV
messages published): the engine's counts, or None.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pickle
import select
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO

from bench.fuzz.engine_inputs import EngineCase
from bench.fuzz.hostile_engine import HostileEngine

_LENGTH = 8
CONTROL_TIMEOUT_S = 30.0


async def _serve_control(
    engine: HostileEngine,
    connections: set[asyncio.Task[Any]],
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> None:
    task = asyncio.current_task()
    assert task is not None
    connections.add(task)
    try:
        while True:
            length = int.from_bytes(await reader.readexactly(_LENGTH), "big")
            op, number, case = pickle.loads(await reader.readexactly(length))
            answer: dict[str, int] | None = None
            if op == "add":
                await engine.set_numbered(number, case)
            elif op == "drop":
                engine.drop_case(number)
            else:
                answer = _counts(engine)
            writer.write(_framed(answer))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()
        connections.discard(task)


async def _main(model: str, control_path: str) -> None:
    loop = asyncio.get_running_loop()
    stdin_closed = asyncio.Event()

    def until_stdin_closes() -> None:
        sys.stdin.read()
        loop.call_soon_threadsafe(stdin_closed.set)

    engine = HostileEngine(model)
    await engine.start()
    connections: set[asyncio.Task[Any]] = set()
    server = await asyncio.start_unix_server(
        lambda r, w: _serve_control(engine, connections, r, w), control_path
    )
    threading.Thread(target=until_stdin_closes, daemon=True).start()
    ports = {
        "port": engine.port,
        "kv_port": engine.kv_port,
        "replay_port": engine.replay_port,
    }
    print(json.dumps(ports), flush=True)
    await stdin_closed.wait()
    server.close()
    # The harness closed its control connections before our stdin: let them end on
    # their own (a handler cancelled at loop close logs a traceback on Python 3.11).
    if connections:
        await asyncio.wait(connections, timeout=CONTROL_TIMEOUT_S)
    await engine.aclose()


def _counts(engine: HostileEngine) -> dict[str, int]:
    return {
        "replies_sent": engine.replies_sent,
        "scrapes": engine.scrapes,
        "published": engine.published,
        "replays": engine.replays,
    }


def _framed(message: object) -> bytes:
    data = pickle.dumps(message)
    return len(data).to_bytes(_LENGTH, "big") + data


class HostileEngineProcess:
    """The harness's side: the engine's addresses, and ``add_case``, ``drop_case`` and
    ``counts`` from any thread (each thread keeps a control connection of its own);
    until ``stop``."""

    def __init__(self, model: str) -> None:
        self._model = model
        self._process: subprocess.Popen[str] | None = None
        self._ports: dict[str, int] = {}
        self._local = threading.local()
        self._sockets: list[socket.socket] = []
        self._sockets_lock = threading.Lock()
        self._control_dir = tempfile.TemporaryDirectory(prefix="kvrouter-hostile-")
        self._control_path = str(Path(self._control_dir.name) / "control")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._ports['port']}"

    @property
    def kv_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self._ports['kv_port']}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self._ports['replay_port']}"

    def start(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.fuzz.hostile_process", self._model, self._control_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        stdout = self._process.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], CONTROL_TIMEOUT_S)
        line = stdout.readline() if ready else ""
        if not line:
            self.stop()
            raise RuntimeError("the hostile engine did not start")
        self._ports = json.loads(line)

    def stop(self) -> None:
        with self._sockets_lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):  # its peer may be gone already
                    sock.shutdown(socket.SHUT_RDWR)  # a makefile() reader keeps it open
                sock.close()
            self._sockets.clear()
        if self._process is not None:
            try:
                self._process.communicate(input="", timeout=60)  # closes its stdin
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._control_dir.cleanup()

    def add_case(self, number: int, case: EngineCase) -> None:
        """The answer to requests marked ``number``; its metrics page the next scrapes',
        its KV messages sent before this returns."""
        self._call(("add", number, case))

    def drop_case(self, number: int) -> None:
        self._call(("drop", number, None))

    def counts(self) -> dict[str, int]:
        """Replies sent, scrapes answered, KV messages published, replays served."""
        counts: dict[str, int] = self._call(("counts", 0, None))
        return counts

    def _call(self, message: tuple[str, int, Any]) -> Any:
        sock, answers = self._connection()
        try:
            sock.sendall(_framed(message))
            length = int.from_bytes(_read_exactly(answers, _LENGTH), "big")
            return pickle.loads(_read_exactly(answers, length))
        except BaseException:
            # A timed-out reader refuses every later read, and a late answer would be
            # taken for the next call's: this thread's next call gets a new connection.
            self._local.conn = None
            answers.close()
            sock.close()
            raise

    def _connection(self) -> tuple[socket.socket, BinaryIO]:
        connection: tuple[socket.socket, BinaryIO] | None = getattr(self._local, "conn", None)
        if connection is None:
            sock = socket.socket(socket.AF_UNIX)
            sock.settimeout(CONTROL_TIMEOUT_S)
            sock.connect(self._control_path)
            connection = self._local.conn = (sock, sock.makefile("rb"))
            with self._sockets_lock:
                self._sockets.append(sock)
        return connection


def _read_exactly(stream: BinaryIO, count: int) -> bytes:
    data = stream.read(count)
    if len(data) != count:
        raise ConnectionError("the hostile engine's control connection closed")
    return data


@contextlib.asynccontextmanager
async def hostile_engine_process(model: str) -> AsyncIterator[HostileEngineProcess]:
    engine = HostileEngineProcess(model)
    await asyncio.to_thread(engine.start)
    try:
        yield engine
    finally:
        await asyncio.to_thread(engine.stop)


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1], sys.argv[2]))
