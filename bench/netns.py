"""Is this process in a loopback-only network namespace? Checked before starting peers.

The peer routers may try to reach a model hub when they start, so the benchmarks that
run them do so only inside a namespace of their own with nothing but loopback up::

    unshare -n bash -c 'ip link set lo up; kvrouter bench throughput --peer-bin /opt/peers/bin'

``/sys/class/net`` is no use for the check: it shows the namespace sysfs was mounted in,
not this process's. ``socket.if_nameindex`` and ``SIOCGIFFLAGS`` on a socket of our own
ask the namespace this process is in.
"""

from __future__ import annotations

import fcntl
import socket
import struct
from collections.abc import Mapping

SIOCGIFFLAGS = 0x8913
IFF_UP = 0x1
IFF_LOOPBACK = 0x8
ISOLATE_HINT = (
    "run it in a loopback-only network namespace: "
    "unshare -n bash -c 'ip link set lo up; kvrouter bench ...'"
)


class NotIsolated(Exception):
    """The network namespace can reach beyond this machine, or cannot reach itself."""


def interface_flags() -> dict[str, int]:
    """Every interface of this process's network namespace and its ``IFF_*`` flags."""
    flags: dict[str, int] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("16sH", name.encode()[:15], 0)
            answer = fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, request)
            flags[name] = struct.unpack("16sH", answer[:18])[1]
    return flags


def outside_interfaces(flags: Mapping[str, int]) -> list[str]:
    """The interfaces that are up and are not loopback."""
    return sorted(n for n, f in flags.items() if f & IFF_UP and not f & IFF_LOOPBACK)


def check_loopback_only(flags: Mapping[str, int]) -> None:
    """Raise ``NotIsolated`` unless loopback is up and nothing else is."""
    outside = outside_interfaces(flags)
    if outside:
        raise NotIsolated(
            f"refusing to start peer routers: network interface(s) {', '.join(outside)} "
            f"up in this namespace; {ISOLATE_HINT}"
        )
    if not any(f & IFF_UP and f & IFF_LOOPBACK for f in flags.values()):
        raise NotIsolated("loopback is down in this namespace: run 'ip link set lo up' first")


def require_loopback_only() -> None:
    """``check_loopback_only`` for the namespace this process is in."""
    check_loopback_only(interface_flags())
