"""Free loopback ports for the workbench's servers and the tests': the one home.

A port a server binds at once may come from ``bind(0)`` (``free_port``). A port chosen
now and bound later (an engine that starts a minute after, a fleet's consecutive ports,
a worker restarted on its port) comes from below the kernel's ephemeral range
(``free_ports``, ``free_port_run``): the kernel draws from that range for every outgoing
connection, so a port chosen there could be held by a connection, or sit in TIME_WAIT,
by the time the server binds it. Ports handed out by this process are not handed out
again while they are fresh (another test may not have bound its own yet).
"""

from __future__ import annotations

import random
import socket
import threading
from collections import deque
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORTS_FROM = 20_000
DEFAULT_EPHEMERAL_LOW = 32_768  # Linux's default, where /proc does not say
REMEMBERED = 4_096  # ports handed out, not handed out again until this many followed

_handed: deque[int] = deque(maxlen=REMEMBERED)
_lock = threading.Lock()
_random = random.Random()


def free_port() -> int:
    """A port free now, for a server that binds it at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_for_later() -> int:
    """A port free now, below the ephemeral range, for a server that binds it later
    (another process, once started)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports, free now, below the ephemeral range."""
    with _lock:
        ports: list[int] = []
        for port in _candidates():
            if port not in _handed and _bindable(port):
                ports.append(port)
                if len(ports) == count:
                    _handed.extend(ports)
                    return ports
    raise OSError(f"no {count} free ports between {PORTS_FROM} and the ephemeral range")


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive ports, free now, below the ephemeral range (a
    simulated fleet listens on base + i)."""
    low = _ephemeral_low()
    with _lock:
        for base in _candidates():
            run = range(base, base + count)
            if run.stop > low or any(port in _handed for port in run):
                continue
            if all(_bindable(port) for port in run):
                _handed.extend(run)
                return base
    raise OSError(f"no {count} consecutive free ports between {PORTS_FROM} and {low}")


def first_taken(ports: list[int], host: str = "127.0.0.1") -> tuple[int, str] | None:
    """The first of ``ports`` a server could not bind now, and why; None if all are free.
    Checked as servers bind (SO_REUSEADDR: a port in TIME_WAIT is free to them)."""
    for port in ports:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                return port, exc.strerror or str(exc)
    return None


def _candidates() -> list[int]:
    low = _ephemeral_low()
    return _random.sample(range(PORTS_FROM, low), low - PORTS_FROM)


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def _bindable(port: int) -> bool:
    """Free to bind without SO_REUSEADDR: neither listened on nor in TIME_WAIT."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
