"""What happened to each turn's prefix, and why it was lost when it was.

Outcomes: ``first_turn`` (a session this router has not seen), ``hit`` (the engine had at
least 90% of the history the turn carries), ``reloaded`` (a hit, part of it read back
from the engine's CPU tier: the worker's GPU held less than the engine found cached, and
its CPU tier held the rest), ``partial`` (some), ``miss`` (under 10%).
A turn that lost part of its history is given one cause:

* ``worker_failed`` — the worker that held the session restarted or was removed since;
* ``routed_elsewhere`` — the turn went to another worker than the one holding it (a load
  decision, or a worker out of rotation);
* ``evicted`` — it went to the worker that held it, and the engine had dropped it;
* ``router_state_lost`` — the router no longer knew where the session was (its index
  entries were lost or trimmed) although the worker did not restart.

Sessions are keyed by the session key (header or body field); requests without one are
classified by hit ratio alone and their cause is ``unknown``. The tracker is a bounded
LRU, so it costs a fixed amount of memory whatever clients send.

Each turn's end says what its session does next (``Waiting``): waits on a tool its reply
called, on a person, or nothing (the client marked the request its session's last); the
time until the session's next request is observed by what it waited on.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Literal, get_args

from router.wire.kinds import TurnEnd

# What happened to a turn's prefix (a request's own end is policies.base.Outcome).
TurnOutcome = Literal["first_turn", "hit", "reloaded", "partial", "miss"]
Cause = Literal["worker_failed", "routed_elsewhere", "evicted", "router_state_lost", "unknown"]
# What a session does after a turn: the reply's end (router.wire.kinds.TurnEnd), or
# nothing more where the client said so.
Waiting = TurnEnd | Literal["finished"]
WAITING: tuple[Waiting, ...] = ("tool", "user", "finished")
TURN_OUTCOMES: tuple[TurnOutcome, ...] = get_args(TurnOutcome)
CAUSES: tuple[Cause, ...] = get_args(Cause)

HIT_SHARE = 0.9
MISS_SHARE = 0.1
DEFAULT_MAX_SESSIONS = 100_000


@dataclass(frozen=True, slots=True)
class SessionMemory:
    worker: str
    worker_epoch: int  # the worker's restart count when the turn ran there
    history_tokens: int  # prompt + reply tokens the next turn will carry
    ended_at: float | None = None  # when the turn's reply ended (router.clock.monotonic)
    waiting_on: Waiting = "user"
    returned: bool = False  # a later request of the session has arrived since


@dataclass(frozen=True, slots=True)
class TurnReport:
    outcome: TurnOutcome
    cause: Cause | None  # set when outcome is partial or miss
    lost_tokens: int


def read_back(cached_tokens: int, on_device_tokens: int, offloaded_tokens: int) -> bool:
    """The engine found more cached than the worker's GPU was modelled to hold, and its
    CPU tier held more: it read some back."""
    return offloaded_tokens > 0 and cached_tokens > on_device_tokens


def classify(
    previous: SessionMemory | None,
    worker: str,
    worker_epochs: dict[str, int],
    prompt_tokens: int,
    cached_tokens: int,
    best_match_tokens: int,
    predicted_tokens: int,
    on_device_tokens: int = 0,
    offloaded_tokens: int = 0,
) -> TurnReport:
    """One turn's outcome; pure, so every rule is testable with plain values.
    ``on_device_tokens``: of the prompt, what the worker's GPU was modelled to hold;
    ``offloaded_tokens``: what its CPU tier held beyond that."""
    if previous is None:
        expected = best_match_tokens
        if expected <= 0:
            return TurnReport("first_turn", None, 0)
    else:
        expected = min(prompt_tokens, previous.history_tokens)
    if expected <= 0 or cached_tokens >= HIT_SHARE * expected:
        if read_back(cached_tokens, on_device_tokens, offloaded_tokens):
            return TurnReport("reloaded", None, 0)
        return TurnReport("hit", None, 0)
    outcome: TurnOutcome = "partial" if cached_tokens >= MISS_SHARE * expected else "miss"
    lost = max(0, expected - cached_tokens)
    if previous is None:
        return TurnReport(outcome, "unknown", lost)
    if worker_epochs.get(previous.worker) != previous.worker_epoch:
        cause: Cause = "worker_failed"  # restarted (epoch moved) or removed (no epoch)
    elif worker != previous.worker:
        cause = "routed_elsewhere"
    elif predicted_tokens >= HIT_SHARE * expected:
        cause = "evicted"  # the router expected it there; the engine had dropped it
    elif best_match_tokens < MISS_SHARE * expected:
        cause = "router_state_lost"
    else:
        cause = "evicted"
    return TurnReport(outcome, cause, lost)


class SessionTracker:
    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self._sessions: OrderedDict[str, SessionMemory] = OrderedDict()
        self._max = max_sessions

    def get(self, key: str | None) -> SessionMemory | None:
        return self._sessions.get(key) if key is not None else None

    def returning(self, key: str | None) -> SessionMemory | None:
        """The session's last turn, if it ended and this is the first request of the
        session since: how long it was away is then known (once per turn)."""
        memory = self.get(key)
        if memory is None or memory.returned or memory.ended_at is None:
            return None
        assert key is not None
        self._sessions[key] = replace(memory, returned=True)
        return memory

    def remember(self, key: str | None, memory: SessionMemory) -> None:
        if key is None:
            return
        self._sessions[key] = memory
        self._sessions.move_to_end(key)
        while len(self._sessions) > self._max:
            self._sessions.popitem(last=False)

    def migrate(self, source: str, target: str, target_epoch: int) -> int:
        """Sessions remembered on ``source`` are on ``target`` now (its state was restored
        there): their next turns are judged against it. Returns how many moved."""
        moved = 0
        for key, memory in self._sessions.items():  # values replaced, the order kept
            if memory.worker == source:
                self._sessions[key] = replace(memory, worker=target, worker_epoch=target_epoch)
                moved += 1
        return moved

    def __len__(self) -> int:
        return len(self._sessions)
