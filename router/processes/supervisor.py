"""The parent of ``kvrouter serve --processes N``: holds the port, runs the processes.

::

    supervisor (this module: no event loop, no threads, serves nothing)
      ├─ state store   valkey-server on <run_dir>/state.sock     (only without state.url)
      ├─ process 0     kvrouter serve --config <run_dir>/config.json --process-slot 0:<run_dir>
      ├─ …
      └─ process N-1

* **The port.** The supervisor binds it with SO_REUSEPORT and never listens on it: the
  port stays held while the router runs (``--port 0`` becomes one number that every
  process binds), and no connection ever waits on the supervisor. Each process listens
  on it with SO_REUSEPORT, and the kernel spreads new connections over the listeners by
  a hash of the connection's addresses (Linux only: elsewhere one listener gets them all).
* **Shared state.** Every process runs the replicas' ``RedisSync`` against ``state.url``
  or, without one, against a store started here (``router/processes/store.py``).
* **Restarts.** A process (or the store) that exits is started again after a backoff:
  ``RESTART_FIRST_S``, doubling up to ``RESTART_MAX_S``, back to the first after it ran
  ``STABLE_S``. One that exits while the group starts up ends the start-up (exit 1): a
  config that cannot serve is reported, not retried forever.
* **Stopping.** SIGTERM or SIGINT: SIGTERM to every process, which finishes its requests
  in flight; the store after them (their last index changes go to it); then exit 0. A
  second signal, or ``STOP_GRACE_S``, kills what is left. Each child is in its own
  session (a terminal's Ctrl-C reaches only the supervisor, which stops them in order)
  and gets SIGTERM from the kernel if the supervisor dies (PR_SET_PDEATHSIG): no orphans,
  and the processes remove the run directory the supervisor could not.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from router.backoff import Backoff
from router.config import RouterConfig
from router.errors import ConfigError
from router.processes import store
from router.processes.slot import STORE_SOCKET, ProcessSlot, write_config

log = logging.getLogger(__name__)

RESTART_FIRST_S = 0.5
RESTART_MAX_S = 30.0
STABLE_S = 30.0  # a process that ran this long before it exited restarts without delay
STORE_READY_S = 10.0
# A process is up once its state runs: the first health probe of every worker
# (health.timeout_s) and the first read of the shared state.
START_TIMEOUT_S = 120.0
# A process gives requests in flight 60 s after SIGTERM (router.server).
STOP_GRACE_S = 65.0
STORE_STOP_S = 5.0
PR_SET_PDEATHSIG = 1


class StartFailed(Exception):
    """A process or the store exited, or never answered, while the group started."""


def _die_with_parent() -> None:
    """In the child between fork and exec: SIGTERM when the supervisor goes, however it
    goes (a process then stops as it would on the supervisor's own SIGTERM). Safe here:
    the supervisor runs no other thread that could hold a lock across the fork."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(slots=True)
class Child:
    """One supervised program: how to start it and whether it serves yet."""

    name: str
    argv: list[str]
    ready: Callable[[], bool]
    quiet: bool = False  # output to /dev/null (the store logs to its own file)
    backoff: Backoff = field(default_factory=lambda: Backoff(RESTART_FIRST_S, RESTART_MAX_S))
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float = 0.0

    def start(self) -> None:
        output = subprocess.DEVNULL if self.quiet else None
        self.process = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.started_at = time.monotonic()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def send(self, sig: int) -> None:
        if self.running:
            assert self.process is not None
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class Signals:
    """SIGTERM, SIGINT and SIGCHLD wake ``wait`` (through a self-pipe); the first two are
    also counted in ``received``."""

    WATCHED = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._previous_fd = signal.set_wakeup_fd(self._write)
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self.WATCHED}

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGCHLD:
            self.received.append(sig)

    def wait(self, timeout_s: float | None) -> None:
        select.select([self._read], [], [], None if timeout_s is None else max(0.0, timeout_s))
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 256):
                pass

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read)
        os.close(self._write)


def _addresses(host: str, port: int) -> list[tuple[int, str]]:
    """(family, address) of every address a server on ``host`` binds, as asyncio's."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return list(dict.fromkeys((int(family), str(address[0])) for family, _, _, _, address in infos))


def _socket(family: int, reuse_port: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    return sock


def reserve_port(host: str, port: int) -> tuple[list[socket.socket], int]:
    """Sockets bound to every address of ``host`` on one port (``port``, or one free port
    for 0) with SO_REUSEPORT and not listening; ConfigError if the port is taken.

    A bind without SO_REUSEPORT comes first: a reservation alone would share the port
    with whoever else listens on it with SO_REUSEPORT (another kvrouter, say)."""
    held: list[socket.socket] = []
    try:
        for family, address in _addresses(host, port):
            for reuse_port in (False, True):
                sock = _socket(family, reuse_port)
                try:
                    sock.bind((address, port))
                except OSError as exc:
                    sock.close()
                    if exc.errno == errno.EADDRINUSE:
                        raise ConfigError(f"port: {address}:{port} is in use") from None
                    raise ConfigError(f"host: cannot bind {address}:{port}: {exc}") from None
                port = sock.getsockname()[1]
                if reuse_port:
                    held.append(sock)
                else:
                    sock.close()
    except BaseException:
        for sock in held:
            sock.close()
        raise
    return held, port


class Supervisor:
    def __init__(self, children: Sequence[Child], store_child: Child | None) -> None:
        self._children = list(children)
        self._store = store_child
        self._signals = Signals()

    @property
    def _all(self) -> list[Child]:
        return ([self._store] if self._store else []) + self._children

    def run(self, serving_message: str) -> int:
        """Start everything, keep it running until a signal, stop it; the exit status."""
        try:
            try:
                if self._store is not None:
                    self._start_group([self._store], STORE_READY_S)
                self._start_group(self._children, START_TIMEOUT_S)
            except StartFailed as exc:
                log.error("%s", exc)
                return 1
            if self._signals.received:
                return 0
            log.info("%s", serving_message)
            self._watch()
            return 0
        finally:
            self._stop()
            self._signals.close()

    def _start_group(self, group: Sequence[Child], timeout_s: float) -> None:
        for child in group:
            child.start()
        deadline = time.monotonic() + timeout_s
        pending = list(group)
        while pending and not self._signals.received:
            for child in pending:
                assert child.process is not None
                code = child.process.poll()
                if code is not None:
                    raise StartFailed(f"{child.name} exited while starting ({describe_exit(code)})")
            pending = [c for c in pending if not c.ready()]
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise StartFailed(f"{names} did not start serving within {timeout_s:g} s")
            if pending:
                self._signals.wait(0.05)

    def _watch(self) -> None:
        while not self._signals.received:
            now = time.monotonic()
            for child in self._all:
                if child.process is not None and child.process.poll() is not None:
                    self._exited(child, child.process.returncode, now)
                elif child.process is None and child.restart_at <= now:
                    log.info("starting %s again", child.name)
                    child.start()
            due = [c.restart_at - now for c in self._all if c.process is None]
            self._signals.wait(min(due) if due else None)

    def _exited(self, child: Child, code: int, now: float) -> None:
        ran_s = now - child.started_at
        if ran_s >= STABLE_S:
            child.backoff.reset()
        delay = child.backoff.next()
        log.warning(
            "%s exited (%s) after %.1f s; starting it again in %.1f s",
            child.name, describe_exit(code), ran_s, delay,
        )  # fmt: skip
        child.process = None
        child.restart_at = now + delay

    def _stop(self) -> None:
        self._terminate(self._children, STOP_GRACE_S)
        if self._store is not None:
            self._terminate([self._store], STORE_STOP_S)

    def _terminate(self, group: Sequence[Child], grace_s: float) -> None:
        """SIGTERM, then SIGKILL after ``grace_s`` or at a further signal; all reaped."""
        signals_before = len(self._signals.received)
        for child in group:
            child.send(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(c.running for c in group):
            if len(self._signals.received) > signals_before or time.monotonic() > deadline:
                for child in group:
                    if child.running:
                        log.warning("%s did not stop; killing it", child.name)
                        child.send(signal.SIGKILL)
                break
            self._signals.wait(deadline - time.monotonic())
        for child in group:
            if child.process is not None:
                child.process.wait()
                child.process = None


def _accepts(path: Path) -> bool:
    with (
        contextlib.suppress(OSError),
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn,
    ):
        conn.settimeout(0.5)
        conn.connect(str(path))
        return True
    return False


def process_argv(config_path: Path, slot: ProcessSlot, log_level: str) -> list[str]:
    return [
        sys.executable, "-m", "router.cli", "--log-level", log_level,
        "serve", "--config", str(config_path), "--process-slot", slot.flag(),
    ]  # fmt: skip


@contextlib.contextmanager
def _run_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvrouter-"))  # mode 0700
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def supervise(config: RouterConfig, log_level: str) -> int:
    """``kvrouter serve`` with ``config.processes`` > 1; the exit status."""
    if not sys.platform.startswith("linux"):
        raise ConfigError(
            "processes: more than one needs Linux (SO_REUSEPORT spreads connections "
            "only there); run one process per port behind a load balancer instead"
        )
    binary = None if config.state.url else store.find_binary()
    with contextlib.ExitStack() as stack:
        held, port = reserve_port(config.host, config.port)
        for sock in held:
            stack.callback(sock.close)
        run_dir = stack.enter_context(_run_dir())
        store_child = None
        state = config.state
        if binary is not None:
            socket_path = run_dir / STORE_SOCKET
            argv = store.store_argv(binary, run_dir, socket_path)
            store_child = Child(
                "state store", argv, lambda: store.answers_ping(socket_path), quiet=True
            )
            state = dataclasses.replace(state, url=f"unix://{socket_path}")
        served = dataclasses.replace(config, port=port, state=state)
        config_path = write_config(served, run_dir)
        slots = [ProcessSlot(i, config.processes, run_dir) for i in range(config.processes)]
        children = [
            Child(f"process {s.index}", process_argv(config_path, s, log_level),
                  functools.partial(_accepts, s.own_socket))
            for s in slots
        ]  # fmt: skip
        where = f"their own store ({binary})" if binary is not None else "state.url"
        message = (
            f"kvrouter on http://{config.host}:{port}: {config.processes} processes "
            f"sharing state through {where}"
        )
        result = Supervisor(children, store_child).run(message)
        if result and binary is not None and store_child is not None:
            tail = store.log_tail(run_dir)
            if tail:
                log.error("state store log: %s", tail)
        return result
