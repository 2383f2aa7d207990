"""CPU time of a process (and its descendants) from ``/proc``, for CPU-per-request figures.

Two sources, each with a flaw the other has not:

* ``/proc/<pid>/task/*/schedstat``: the first field is the task's time on a CPU in
  nanoseconds, exact, but only for threads still alive: a thread that exits between two
  readings takes its time with it.
* ``/proc/<pid>/stat`` utime + stime: the whole thread group's, exited threads included,
  but in clock ticks (10 ms).

``CpuSample.since`` takes the schedstat difference unless the stat difference is larger
by more than its resolution allows (a thread exited), and then the stat one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Each of utime and stime is rounded down to a tick, at both ends of an interval.
STAT_SLACK_TICKS = 4


def _stat_fields(text: str) -> list[str]:
    """The fields after ``comm``, which may itself hold spaces and parentheses."""
    return text[text.rindex(")") + 2 :].split()


def stat_ticks(pid: int, proc: Path = PROC) -> tuple[int, int]:
    """utime and stime of the whole thread group, in clock ticks."""
    fields = _stat_fields((proc / str(pid) / "stat").read_text())
    return int(fields[11]), int(fields[12])


def schedstat_ns(pid: int, proc: Path = PROC) -> int:
    """The on-CPU time of every live thread of ``pid``, in nanoseconds."""
    total = 0
    for task in (proc / str(pid) / "task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue  # the thread exited while we read
    return total


def descendants(pid: int, proc: Path = PROC) -> list[int]:
    """``pid`` and every process below it, found by the parent ids in ``/proc/*/stat``."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int(_stat_fields((entry / "stat").read_text())[1])
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, ()))
    return found


@dataclass(frozen=True, slots=True)
class ProcessCpu:
    schedstat_ns: int
    stat_ticks: int  # user + system
    system_ticks: int = 0

    def seconds_since(self, earlier: ProcessCpu) -> float:
        exact = (self.schedstat_ns - earlier.schedstat_ns) / 1e9
        ticks = self.stat_ticks - earlier.stat_ticks
        coarse = ticks / CLOCK_TICKS
        slack = STAT_SLACK_TICKS / CLOCK_TICKS + 0.01 * coarse
        return coarse if coarse > exact + slack else max(exact, 0.0)


@dataclass(frozen=True, slots=True)
class CpuSample:
    """The CPU readings of a set of processes at one moment."""

    processes: Mapping[int, ProcessCpu]

    def since(self, earlier: CpuSample) -> float:
        """CPU seconds the processes used between ``earlier`` and this sample; a process
        that is new here counts from zero, one that is gone counts no more."""
        zero = ProcessCpu(0, 0)
        return sum(
            cpu.seconds_since(earlier.processes.get(pid, zero))
            for pid, cpu in self.processes.items()
        )

    def system_share_since(self, earlier: CpuSample) -> float:
        """The kernel's share of that time (from the stat ticks): system calls, and on
        loopback the receiving socket's side of every send too."""
        zero = ProcessCpu(0, 0)
        total = system = 0
        for pid, cpu in self.processes.items():
            before = earlier.processes.get(pid, zero)
            total += cpu.stat_ticks - before.stat_ticks
            system += cpu.system_ticks - before.system_ticks
        return system / total if total > 0 else 0.0


def sample(pids: Iterable[int], proc: Path = PROC) -> CpuSample:
    """Readings of ``pids`` and their descendants; processes gone already are skipped."""
    readings: dict[int, ProcessCpu] = {}
    for root in pids:
        for pid in descendants(root, proc):
            try:
                user, system = stat_ticks(pid, proc)
                readings[pid] = ProcessCpu(schedstat_ns(pid, proc), user + system, system)
            except (FileNotFoundError, ProcessLookupError):
                continue
    return CpuSample(readings)
