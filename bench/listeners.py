"""Which processes listen on a TCP port, from ``/proc``: to measure a router's CPU when
its command line says nothing of its port (SMG renames its process with
``setproctitle``, so ``bench.compare.agreement.router_pids``' look at the arguments finds
nothing).

``/proc/net/tcp`` and ``tcp6`` list this network namespace's sockets, a listening one
in state ``0A`` with its inode; a process holds it as a ``socket:[inode]`` link among
its ``fd``s.
"""

from __future__ import annotations

from pathlib import Path

from bench.proc_cpu import PROC

LISTEN = "0A"


def listening_inodes(port: int, proc: Path = PROC) -> set[int]:
    """The inodes of the sockets listening on ``port``, IPv4 and IPv6."""
    inodes: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = (proc / "net" / table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue  # no IPv6 in this kernel
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(int(inode))
    return inodes


def pids_listening(port: int, proc: Path = PROC) -> list[int]:
    """The processes holding a socket that listens on ``port`` (ascending)."""
    wanted = {f"socket:[{inode}]" for inode in listening_inodes(port, proc)}
    found: list[int] = []
    if not wanted:
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        if _links(entry / "fd") & wanted:
            found.append(int(entry.name))
    return sorted(found)


def _links(fds: Path) -> set[str]:
    """Where a process's file descriptors point; empty if it is gone or not ours."""
    links: set[str] = set()
    try:
        for fd in fds.iterdir():
            try:
                links.add(str(fd.readlink()))
            except FileNotFoundError:
                continue  # closed while we read
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return links
