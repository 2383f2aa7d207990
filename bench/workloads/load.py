"""Offered load: a workload's sessions re-timed to arrive at a multiple of what the
fleet can serve.

Sessions arrive open-loop (at their own times, whatever the fleet is doing); a session's
turns stay closed-loop (each after the previous reply and its pause). The fleet's
capacity is measured in turns a second: every session of the workload starts at once
(``all_at_once``) and the turns completed while the fleet is saturated are counted
(``bench.compare.offered_load``). At load ``L`` sessions then arrive at ``L x capacity / turns per
session`` a second (``at_load``): the turns they bring, ``L`` times what the fleet
completed when it had all it could take. The spacing of the workload's own arrivals
(its Poisson draws, a trace's bursts) is kept, stretched or squeezed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from bench.workloads.trace import Turn, group_sessions


def turns_per_session(turns: Sequence[Turn]) -> float:
    sessions = group_sessions(turns)
    return len(turns) / len(sessions) if sessions else 0.0


def session_rate(turns: Sequence[Turn]) -> float:
    """Sessions a second over the span of their arrivals (0: one session, or all at once)."""
    starts = sorted(s.arrival for s in group_sessions(turns))
    span = starts[-1] - starts[0] if starts else 0.0
    return (len(starts) - 1) / span if span > 0 else 0.0


def _shift_sessions(turns: Sequence[Turn], scale: float) -> list[Turn]:
    """Each session's start offset from the first multiplied by ``scale``; its turns
    keep their times relative to its start."""
    sessions = group_sessions(turns)
    if not sessions:
        return []
    first = sessions[0].arrival
    out: list[Turn] = []
    for session in sessions:
        shift = (session.arrival - first) * (scale - 1.0)
        out.extend(dataclasses.replace(t, arrival=t.arrival + shift) for t in session.turns)
    return out


def all_at_once(turns: Sequence[Turn]) -> list[Turn]:
    """Every session starting with the first: the capacity probe's workload."""
    return _shift_sessions(turns, 0.0)


def at_load(turns: Sequence[Turn], load: float, capacity_turns_per_s: float) -> list[Turn]:
    """``turns`` with sessions arriving so that they bring ``load`` x the capacity."""
    if load <= 0 or capacity_turns_per_s <= 0:
        raise ValueError("load and capacity must be > 0")
    current = session_rate(turns)
    if current <= 0:
        raise ValueError("the workload's sessions arrive all at once: no rate to scale")
    wanted = load * capacity_turns_per_s / turns_per_session(turns)
    return _shift_sessions(turns, current / wanted)
