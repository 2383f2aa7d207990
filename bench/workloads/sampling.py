"""Random draws and session assembly shared by the workload generators.

Every generator draws each session from its own ``random.Random`` seeded by a string
(``session_rng``), so a session depends only on the seed and its index: asking for more
sessions appends sessions and leaves the earlier ones unchanged. String seeds hash with
SHA-512 inside ``random``, so traces do not depend on ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from bench.workloads.trace import TextBlock, TextSpec, Turn, text_tokens


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A log-normal distribution given by its median, clipped to ``[low, high]``.

    ``sigma`` is the standard deviation of the underlying normal: 0.5 is narrow, 1.0 and
    above is heavy-tailed. Clipping moves no mass across the median, so the median of the
    clipped draws is still ``median`` when ``low <= median <= high``.
    """

    median: float
    sigma: float
    low: float
    high: float

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.median <= self.high:
            raise ValueError(f"need 0 < low <= median <= high, got {self}")
        if self.sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")

    def draw(self, rng: random.Random) -> float:
        value = self.median * math.exp(rng.gauss(0.0, self.sigma))
        return min(self.high, max(self.low, value))

    def draw_int(self, rng: random.Random) -> int:
        return round(self.draw(rng))


def check_population(sessions: int, rate: float) -> None:
    """Validate the two knobs every generator shares."""
    if sessions < 0:
        raise ValueError(f"sessions must be >= 0, got {sessions}")
    if rate <= 0:
        raise ValueError(f"rate must be > 0 sessions/s, got {rate}")


def session_rng(seed: int, kind: str, index: int) -> random.Random:
    return random.Random(f"{kind}:{seed}:{index}")


def poisson_arrivals(seed: int, kind: str, rate: float, count: int) -> list[float]:
    """Session start times of a Poisson process with ``rate`` sessions/s.

    The first session starts at 0 so a replay does not open with an idle stretch.
    """
    rng = random.Random(f"{kind}:{seed}:arrivals")
    arrivals: list[float] = []
    now = 0.0
    for i in range(count):
        if i:
            now += rng.expovariate(rate)
        arrivals.append(now)
    return arrivals


def zipf_weights(count: int, exponent: float) -> list[float]:
    """Popularity of ranks 1..count under Zipf's law (unnormalised)."""
    return [1.0 / (rank**exponent) for rank in range(1, count + 1)]


def user_text(session: str, turn: int, tokens: int) -> TextSpec:
    """A user message unique to its session and turn."""
    return (TextBlock(f"{session}/t{turn}", tokens),)


def build_session(
    session: str,
    arrival: float,
    system: TextSpec | None,
    users: Sequence[int],
    outputs: Sequence[int],
    gaps: Sequence[float],
) -> list[Turn]:
    """The turns of one generated session.

    ``gaps[0]`` is ignored (turn 0 has none). A later turn's ``arrival`` is the previous
    arrival plus its gap: a lower bound on when the source would issue it, since the
    response time in between is only known at replay (which waits the gap itself).
    """
    turns: list[Turn] = []
    now = arrival
    for k, (user_tokens, output_tokens) in enumerate(zip(users, outputs, strict=True)):
        gap = gaps[k] if k else 0.0
        now += gap
        turns.append(
            Turn(
                session=session,
                turn=k,
                arrival=now,
                gap=gap,
                user=user_text(session, k, user_tokens),
                output_tokens=output_tokens,
                system=system if k == 0 else None,
            )
        )
    return turns


def shift_session(turns: Sequence[Turn], arrival: float) -> list[Turn]:
    """A session's turns moved so that turn 0 arrives at ``arrival`` (gaps unchanged)."""
    if not turns:
        return []
    delta = arrival - turns[0].arrival
    return [replace(turn, arrival=turn.arrival + delta) for turn in turns]


def within_context(turns: Sequence[Turn], limit: int) -> list[Turn]:
    """A session's turns before the first whose prompt plus reply passes ``limit`` tokens
    (0: no limit): where an agent compacts or stops, and past which engines refuse."""
    if not limit:
        return list(turns)
    kept: list[Turn] = []
    context = 0
    for turn in turns:
        context += text_tokens(turn.user) + (text_tokens(turn.system) if turn.system else 0)
        if context + turn.output_tokens > limit:
            break
        kept.append(turn)
        context += turn.output_tokens
    return kept


def sessions_in_order(turns: Sequence[Turn]) -> list[list[Turn]]:
    """Turns grouped by session, sessions in order of first appearance."""
    by_id: dict[str, list[Turn]] = {}
    for turn in turns:
        by_id.setdefault(turn.session, []).append(turn)
    return [sorted(group, key=lambda t: t.turn) for group in by_id.values()]
