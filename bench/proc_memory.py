"""A process's resident memory from ``/proc``, for the benchmarks that watch for leaks."""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


def rss_bytes(pid: int, proc: Path = PROC) -> int:
    """Resident set size (``VmRSS`` in ``/proc/<pid>/status``)."""
    for line in (proc / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for process {pid}")


def rss_kib(pid: int) -> int | None:
    """``rss_bytes`` in KiB, or None when the process is gone."""
    try:
        return rss_bytes(pid) // 1024
    except (OSError, ValueError):
        return None
