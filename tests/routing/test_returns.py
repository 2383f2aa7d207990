"""How likely a session is to come back, learned per state, and what a placement on a
full cache would make returning sessions prefill again."""

from __future__ import annotations

import pytest

from router.routing.returns import MAX_SESSIONS_WALKED, MIN_ENDS, ResidentSessions, ReturnTimes


def _learned(returns: list[float], ends: int, state: str = "tool") -> ReturnTimes:
    times = ReturnTimes()
    for _ in range(ends):
        times.ended(state)  # type: ignore[arg-type]
    for away in returns:
        times.returned(state, away)  # type: ignore[arg-type]
    return times


def test_a_session_is_less_likely_back_the_longer_it_stays_away() -> None:
    """Half the turns are followed by another, all within 1-2 s: a session idle 0.1 s is
    as likely back as ever (1/2), one idle 1.5 s half as likely to be still coming
    (P = 0.25 / 0.75), one idle a minute not at all."""
    times = _learned([1.5] * 50, ends=100)
    assert times.p_return("tool", 0.1) == pytest.approx(0.5)
    assert times.p_return("tool", 1.5) == pytest.approx(1 / 3)
    assert times.p_return("tool", 60.0) == 0.0


def test_states_are_learned_apart_and_guessed_until_seen() -> None:
    times = _learned([2.0] * 40, ends=40, state="tool")
    for _ in range(MIN_ENDS):
        times.ended("user")
    assert times.p_return("tool", 0.5) == pytest.approx(1.0)  # every tool call came back
    assert times.p_return("user", 0.5) == 0.0  # no person did
    fresh = ReturnTimes()
    assert fresh.p_return("tool", 1.0) == 1.0
    assert fresh.p_return("finished", 1.0) == 0.0
    assert 0 < fresh.p_return("user", 1.0) < 1


def test_old_traffic_fades() -> None:
    """Thousands of tool calls that all came back, then as many that did not: the share
    follows the newer traffic."""
    times = _learned([1.0] * 4000, ends=4000)
    for _ in range(8000):
        times.ended("tool")
    assert times.return_share("tool") < 0.25


def test_a_placement_pushes_out_the_oldest_sessions_weighed_by_their_return() -> None:
    times = _learned([1.0] * 100, ends=100, state="tool")  # tool calls: back in a second
    for _ in range(100):
        times.ended("finished")
    sessions = ResidentSessions(times)
    sessions.ended("w", "done", 4_000, "finished", at=0.0, capacity_tokens=20_000)
    sessions.ended("w", "agent", 6_000, "tool", at=10.0, capacity_tokens=20_000)
    sessions.ended("w", "agent-2", 6_000, "tool", at=10.2, capacity_tokens=20_000)
    now = 10.5
    # The first 4K tokens out are the finished session's: nobody misses them.
    assert sessions.returning_tokens("w", 4_000, now) == 0.0
    # 3K more reach the agent's, which is expected back (idle 0.5 s of ~1 s returns).
    assert sessions.returning_tokens("w", 7_000, now) == pytest.approx(3_000, rel=0.01)
    # A session that is back is in use, not at the cache's end.
    sessions.returned("agent")
    assert sessions.returning_tokens("w", 7_000, now) == pytest.approx(3_000, rel=0.01)
    assert sessions.returning_tokens("w", 4_000, now) == 0.0
    assert sessions.returning_tokens("other", 4_000, now) == 0.0


def test_sessions_past_the_capacity_are_gone_and_a_lost_cache_holds_none() -> None:
    sessions = ResidentSessions(ReturnTimes())
    for i in range(5):
        sessions.ended("w", f"s{i}", 4_000, "tool", at=float(i), capacity_tokens=10_000)
    assert sessions.sessions_on("w") == 2  # 8K of the newest fit; the older are evicted
    sessions.migrate("w", "v")
    assert sessions.sessions_on("w") == 0 and sessions.sessions_on("v") == 2
    sessions.forget("v")
    assert sessions.sessions_on("v") == 0
    assert sessions.returning_tokens("v", 1_000, 10.0) == 0.0
    sessions.returned("s4")  # forgotten already: nothing to do


def test_past_the_last_bound_a_session_thins_out_instead_of_staying_forever() -> None:
    """One person in two came back, some after more than half an hour: a session idle an
    hour is less likely back than one idle 31 minutes, one idle a week nearly not."""
    times = _learned([60.0] * 30 + [4_000.0] * 20, ends=100, state="user")
    assert times.p_return("user", 1_900) > times.p_return("user", 3_600) > 0
    assert times.p_return("user", 7 * 86_400) < 0.01


def test_a_flood_of_tiny_sessions_is_walked_no_further_than_a_bound() -> None:
    sessions = ResidentSessions(ReturnTimes())
    for i in range(MAX_SESSIONS_WALKED * 4):
        sessions.ended("w", f"s{i}", 10, "tool", at=float(i), capacity_tokens=10**9)
    walked = sessions.returning_tokens("w", 10**6, now=float(MAX_SESSIONS_WALKED * 4))
    assert walked == 10 * MAX_SESSIONS_WALKED


def test_migrating_a_worker_onto_itself_changes_nothing() -> None:
    sessions = ResidentSessions(ReturnTimes())
    sessions.ended("w", "s", 4_000, "tool", at=0.0, capacity_tokens=10_000)
    sessions.migrate("w", "w")
    sessions.ended("w", "t", 4_000, "tool", at=1.0, capacity_tokens=10_000)
    assert sessions.sessions_on("w") == 2  # 8K held: both fit
    assert sessions.returning_tokens("w", 10_000, 1.0) == 8_000
