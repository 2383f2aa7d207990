"""What the router learns from responses (router.routing.learning), on plain values."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.apis.request import ClientRequest, parse_request
from router.fleet.demand import RecentDemand
from router.fleet.workers import Fleet, Worker
from router.index.residency import LocalPrefixIndex
from router.observability.metrics import RouterMetrics
from router.routing.dispatch import Dispatch, EngineUsage, Router
from router.routing.learning import WorkerSpeeds
from router.routing.policy_slot import PolicySlot


def test_worker_speeds_learn_a_slower_worker_slowly_and_within_bounds() -> None:
    speeds = WorkerSpeeds()
    assert speeds.ratio("a100") == 1.0
    for _ in range(200):  # the A100 prefills at a third of the fleet's rate
        speeds.observe("a100", 10_000, 3.0, 10_000.0)
        speeds.observe("h100", 10_000, 1.0, 10_000.0)
    assert speeds.ratio("a100") == pytest.approx(1 / 3, rel=0.01)
    assert speeds.ratio("h100") == pytest.approx(1.0)
    speeds.observe("h100", 10_000, 0.5, 10_000.0)
    assert speeds.learned("h100") == pytest.approx(1.05)  # one sample only tilts it
    for _ in range(5):  # a burst of fast samples: within the deadband, still 1
        speeds.observe("h100", 10_000, 0.5, 10_000.0)
    assert 1.1 < speeds.learned("h100") < 1.5 and speeds.ratio("h100") == 1.0
    for _ in range(500):
        speeds.observe("stalled", 10_000, 1000.0, 10_000.0)
        speeds.observe("small", 100, 1000.0, 10_000.0)  # too few tokens to say anything
    assert speeds.ratio("stalled") == 0.25 and speeds.ratio("small") == 1.0
    speeds.reset("a100")
    assert speeds.ratio("a100") == 1.0


def test_recent_demand_fades_by_half_each_half_life() -> None:
    demand = RecentDemand(half_life_s=30.0)
    assert demand.value(0.0) == 0.0
    demand.add(80_000, now=100.0)
    assert demand.value(130.0) == pytest.approx(40_000)
    assert demand.value(160.0) == pytest.approx(20_000)
    demand.add(5_000, now=160.0)
    assert demand.value(160.0) == pytest.approx(25_000)
    assert demand.value(150.0) == pytest.approx(25_000)  # a late reader sees no growth
    with pytest.raises(ValueError, match="half_life_s"):
        RecentDemand(half_life_s=0)


def _a_settled_router() -> Router:
    fleet, index = Fleet(), LocalPrefixIndex()
    for name in ("a100", "h100"):
        fleet.add(Worker(name, f"http://{name}", 64_000))
        index.add_worker(name, 1000)
    metrics = RouterMetrics(fleet, index, 64)
    router = Router(fleet, index, PolicySlot("round_robin", {}, 1, metrics), 64, metrics)
    rate = router.learner.prefill_rate
    rate.tokens_per_s, rate.samples = 10_000.0, 100
    return router


def _dispatch_to(router: Router, worker: str, prompt_words: int) -> Dispatch:
    body = {"model": "m", "messages": [{"role": "user", "content": "word " * prompt_words}]}
    request = parse_request("chat", orjson.dumps(body), 256)
    others = [w.name for w in router.fleet.all() if w.name != worker]
    return router.dispatch(request, router.route_request(request, "r"), others)


@pytest.mark.parametrize(
    ("queued", "own", "learns"), [(0, 4000, True), (4000, 4000, True), (4000, 3999, False)]
)
def test_a_worker_learns_its_speed_from_requests_mostly_its_own_prefill(
    queued: int, own: int, learns: bool
) -> None:
    router = _a_settled_router()
    ahead = _dispatch_to(router, "a100", 100)
    slow = _dispatch_to(router, "a100", 100)
    slow.queued_before = queued  # what the worker had queued when this request was sent
    slow.ttft = (queued + own) / 10_000 * 3  # the worker prefills at a third of the fleet
    router.learner.learn(slow, EngineUsage(prompt_tokens=own + 500, cached_tokens=500))
    ahead.fail("upstream_error")
    assert (router.learner.speeds.learned("a100") < 1.0) is learns


def _chat(text: str, session: str | None = None) -> ClientRequest:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": text}]}
    if session is not None:
        body["user"] = session
    return parse_request("chat", orjson.dumps(body), 256)


def test_a_full_cache_counts_the_sessions_a_placement_would_push_out_until_they_return() -> None:
    """Two agents' turns ended on a100 calling tools; its cache is full. A new session's
    placement there would push out the older agent, who is expected back: the view says
    how many tokens. Once that agent's next turn arrives it is in use, not pushed out.
    Counted only for a policy that reads it, and not for a worker removed meanwhile."""
    router = _a_settled_router()
    a100 = router.fleet.workers["a100"]
    a100.capacity_tokens = 2_560
    # Calibrated to half: 20 blocks of 64 tokens, 1,280 tokens modelled, as the engine
    # held less than its nominal capacity.
    router.learner.calibrator._share["a100"] = 0.5
    router.index.resize_worker("a100", 20)

    def agent_turn(session: str) -> Dispatch:
        request = _chat(f"{session} word " * 300, session)
        dispatch = router.dispatch(request, router.route_request(request, "r"), ["h100"])
        router.index.touch("a100", dispatch.route.block_hashes)
        dispatch.turn_end = "tool"
        return dispatch

    router.learner.turn_ended(agent_turn("agent-1"), 600)
    last = agent_turn("agent-2")
    router.learner.turn_ended(last, 600)
    memory = router.learner.sessions.get(last.route.session_key)
    assert memory is not None and memory.ended_at is not None
    now = memory.ended_at  # agent-2 has just ended: as likely back as any
    route = router.route_request(_chat("fresh " * 400), "n")

    def at_risk() -> float:
        return router._view(a100, route, now, counts_returns=True).returning_evicted_tokens

    # All of agent-1's history (a tool call away, the oldest) and the head of agent-2's.
    assert 600 < at_risk() < 1200
    assert router._view(a100, route, now).returning_evicted_tokens == 0  # not asked for
    router.learner.session_returns(router.route_request(_chat("x", "agent-1"), "r").session_key)
    assert at_risk() == 600  # what would be pushed out now is agent-2's alone
    router.learner.forget("a100")
    assert at_risk() == 0.0
    in_flight = agent_turn("agent-3")
    router.fleet.remove("a100")  # the worker left while the turn ran
    router.learner.forget("a100")
    router.learner.turn_ended(in_flight, 600)
    assert router.learner.resident_sessions.sessions_on("a100") == 0
