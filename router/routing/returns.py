"""When sessions come back, and what a worker's cache would lose by taking more.

An engine gives up the blocks of the session whose turn ended longest ago first (vLLM
frees a finished request's blocks to the tail of an LRU queue). Whether losing them
matters depends on whether that session is coming back: an agent waiting on a tool is
back in seconds, a person in minutes or never, and a session its client marked finished
not at all.

``ReturnTimes`` learns that from the traffic, per state a turn left its session in
(``router.observability.outcomes.Waiting``): of the turns that ended in a state, the share
whose session came back, and how long they were away (counts over ``RETURN_BUCKETS``, the
bounds of ``kvrouter_session_return_seconds``, fading so the model follows the traffic).
A session idle for ``a`` seconds comes back with probability::

    P(a) = p S(a) / (p S(a) + 1 - p)

where ``p`` is the share of turns in its state that were followed by another and
``S(a)`` the share of those returns that took longer than ``a``.

``ResidentSessions`` keeps, per worker, the sessions whose last turn ran there, oldest end
first, with the tokens each left cached, trimmed to the capacity the worker is modelled
with (its calibrated share of the nominal: older ones are gone). A request that stores
``n`` new tokens on a full cache pushes out the oldest ``n``: ``returning_tokens(worker,
n)`` is how many of those the sessions they belong to are expected to need again, each
session's tokens weighed by ``P`` of its idle time. The cost policy uses it to place
work where the fewest of them are (``policies.ttft``'s ``ties_spare_returns`` and
``return_weight``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from typing import NamedTuple

from router.observability.metrics import RETURN_BUCKETS
from router.observability.outcomes import WAITING, Waiting

# Until a state has seen this many turn ends its guess stands in for the learned share.
MIN_ENDS = 20
# Turn ends per state after which every count of the state is halved: the model covers
# the last few thousand turns, so a change in the traffic shows within minutes.
FADE_AFTER_ENDS = 4_000
# Guesses for a state not seen enough yet: a tool's result comes back, a finished
# session does not, a person may.
PRIOR_RETURN_SHARE: dict[Waiting, float] = {"tool": 1.0, "user": 0.5, "finished": 0.0}
# Sessions remembered per worker beyond which the oldest are dropped whatever their size.
MAX_SESSIONS_PER_WORKER = 20_000
# Sessions a placement's count walks at most: a request pushes out about its own new
# tokens, a few sessions' worth; past this many (a flood of tiny sessions) the rest of
# what it pushes out counts as not coming back.
MAX_SESSIONS_WALKED = 64


class ReturnTimes:
    """The learned return-time distribution of each state."""

    __slots__ = ("_away", "_ends", "_later", "_returns")

    def __init__(self) -> None:
        self._ends: dict[Waiting, float] = dict.fromkeys(WAITING, 0.0)
        self._returns: dict[Waiting, float] = dict.fromkeys(WAITING, 0.0)
        # Returns by how long the session was away: one count per bucket and one past the
        # last bound.
        self._away: dict[Waiting, list[float]] = {
            w: [0.0] * (len(RETURN_BUCKETS) + 1) for w in WAITING
        }
        # Per state, the returns in bucket i and after it (made again once changed): read
        # for every session a placement would push out, changed once a turn.
        self._later: dict[Waiting, list[float] | None] = dict.fromkeys(WAITING)

    def ended(self, state: Waiting) -> None:
        self._ends[state] += 1
        if self._ends[state] > FADE_AFTER_ENDS:
            self._ends[state] /= 2
            self._returns[state] /= 2
            self._away[state] = [c / 2 for c in self._away[state]]
            self._later[state] = None

    def returned(self, state: Waiting, away_s: float) -> None:
        self._returns[state] += 1
        self._away[state][bisect_right(RETURN_BUCKETS, away_s)] += 1
        self._later[state] = None

    def return_share(self, state: Waiting) -> float:
        """Of the turns that ended in ``state``, the share followed by another."""
        ends = self._ends[state]
        if ends < MIN_ENDS:
            return PRIOR_RETURN_SHARE[state]
        return min(1.0, self._returns[state] / ends)

    def still_away(self, state: Waiting, idle_s: float) -> float:
        """``S(idle_s)``: the share of returns in ``state`` that took longer than that
        (linear within a bucket; 1 while nothing is learned)."""
        later = self._later[state]
        if later is None:
            later = self._later[state] = _suffix_sums(self._away[state])
        total = later[0]
        if total <= 0:
            return 1.0
        i = bisect_right(RETURN_BUCKETS, idle_s)
        counts = self._away[state]
        if i == len(RETURN_BUCKETS):
            # Past the last bound nothing is known of when they came back: the share
            # thins out as the idle time grows, so a session idle for days is not kept.
            return counts[i] * RETURN_BUCKETS[-1] / idle_s / total
        low = RETURN_BUCKETS[i - 1] if i > 0 else 0.0
        high = RETURN_BUCKETS[i]
        return (later[i + 1] + counts[i] * (high - idle_s) / (high - low)) / total

    def p_return(self, state: Waiting, idle_s: float) -> float:
        """How likely a session idle ``idle_s`` seconds since a turn ended in ``state`` is
        to come back."""
        share = self.return_share(state)
        if share <= 0:
            return 0.0
        waiting = share * self.still_away(state, idle_s)
        return waiting / (waiting + 1 - share) if waiting > 0 else 0.0


def _suffix_sums(counts: list[float]) -> list[float]:
    """``[sum(counts[i:]) for i in range(len(counts) + 1)]``."""
    sums = [0.0] * (len(counts) + 1)
    for i in range(len(counts) - 1, -1, -1):
        sums[i] = sums[i + 1] + counts[i]
    return sums


class _Left(NamedTuple):
    tokens: int
    ended_at: float
    state: Waiting


class ResidentSessions:
    """Per worker, the sessions whose last turn ended there, oldest first."""

    __slots__ = ("_by_worker", "_tokens", "_worker_of", "times")

    def __init__(self, times: ReturnTimes) -> None:
        self.times = times
        self._by_worker: dict[str, OrderedDict[str, _Left]] = {}
        self._tokens: dict[str, int] = {}
        self._worker_of: dict[str, str] = {}

    def ended(
        self,
        worker: str,
        session: str,
        tokens: int,
        state: Waiting,
        at: float,
        capacity_tokens: int,
    ) -> None:
        """A turn of ``session`` ended on ``worker`` leaving ``tokens`` cached there."""
        self.returned(session)
        sessions = self._by_worker.setdefault(worker, OrderedDict())
        sessions[session] = _Left(tokens, at, state)
        self._worker_of[session] = worker
        total = self._tokens.get(worker, 0) + tokens
        # The oldest sessions past the capacity are gone from the cache; keep the newest
        # even alone past it.
        while len(sessions) > 1 and (
            total > capacity_tokens or len(sessions) > MAX_SESSIONS_PER_WORKER
        ):
            gone, left = sessions.popitem(last=False)
            del self._worker_of[gone]
            total -= left.tokens
        self._tokens[worker] = total

    def returned(self, session: str) -> None:
        """A request of ``session`` arrived: its tokens are in use, not at the LRU's end."""
        worker = self._worker_of.pop(session, None)
        if worker is None:
            return
        left = self._by_worker[worker].pop(session)
        self._tokens[worker] -= left.tokens

    def forget(self, worker: str) -> None:
        """``worker`` left or lost its cache."""
        for session in self._by_worker.pop(worker, {}):
            del self._worker_of[session]
        self._tokens.pop(worker, None)

    def migrate(self, source: str, target: str) -> None:
        """What ``source`` held is on ``target`` now (its state was restored there)."""
        if source == target:
            return
        moved = self._by_worker.pop(source, OrderedDict[str, _Left]())
        if not moved:
            return
        held = self._by_worker.get(target, OrderedDict[str, _Left]())
        merged = sorted([*held.items(), *moved.items()], key=lambda kv: kv[1].ended_at)
        self._by_worker[target] = OrderedDict(merged)
        self._tokens[target] = self._tokens.get(target, 0) + self._tokens.pop(source, 0)
        for session in moved:
            self._worker_of[session] = target

    def returning_tokens(self, worker: str, evicted_tokens: float, now: float) -> float:
        """Of the ``evicted_tokens`` oldest tokens on ``worker``, how many their sessions
        are expected to need again."""
        expected = 0.0
        left_to_evict = evicted_tokens
        sessions = self._by_worker.get(worker, OrderedDict[str, _Left]()).values()
        for walked, left in enumerate(sessions):
            if left_to_evict <= 0 or walked == MAX_SESSIONS_WALKED:
                break
            taken = min(left.tokens, left_to_evict)
            expected += taken * self.times.p_return(left.state, now - left.ended_at)
            left_to_evict -= taken
        return expected

    def sessions_on(self, worker: str) -> int:
        return len(self._by_worker.get(worker, {}))
