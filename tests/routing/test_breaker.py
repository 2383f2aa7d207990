"""The circuit breaker, on a fake clock and end to end against a worker that fails fast."""

from __future__ import annotations

import aiohttp

from router.config import HealthConfig
from router.fleet.breaker import BreakerState, CircuitBreaker
from tests.conftest import EngineFactory, router_config, serve_router
from tests.router_client import chat_body, engines, metric, post, set_faults, wait_for


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def state(breaker: CircuitBreaker) -> BreakerState:
    return breaker.state


def reported(breaker: CircuitBreaker) -> BreakerState:
    return breaker.reported_state


def fail(breaker: CircuitBreaker) -> None:
    breaker.on_failure(breaker.on_dispatch())


def test_opens_after_consecutive_failures_and_half_opens_after_cooldown() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=1.0, max_cooldown_s=4.0, clock=clock)
    for _ in range(2):
        fail(breaker)
    breaker.on_success(breaker.on_dispatch())  # failures must be consecutive
    for _ in range(2):
        fail(breaker)
    assert breaker.allows()
    fail(breaker)
    assert state(breaker) is BreakerState.OPEN and not breaker.allows()
    clock.now = 1.0
    assert breaker.allows() and state(breaker) is BreakerState.HALF_OPEN
    trial = breaker.on_dispatch()
    assert not breaker.allows()  # one trial at a time
    breaker.on_failure(trial)  # the trial failed: open again, for twice as long
    clock.now = 2.5
    assert not breaker.allows()
    clock.now = 3.0
    assert breaker.allows()
    breaker.on_success(breaker.on_dispatch())
    assert state(breaker) is BreakerState.CLOSED and breaker.allows()


def test_an_open_circuit_past_its_cooldown_is_reported_half_open() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=1.0, clock=clock)
    fail(breaker)
    assert reported(breaker) is BreakerState.OPEN
    clock.now = 1.0
    # No request has asked yet, but the next one would be the trial.
    assert state(breaker) is BreakerState.OPEN
    assert reported(breaker) is BreakerState.HALF_OPEN
    assert breaker.allows()
    breaker.on_failure(breaker.on_dispatch())  # open again for 2 s
    clock.now = 2.5
    assert reported(breaker) is BreakerState.OPEN
    clock.now = 3.0
    assert reported(breaker) is BreakerState.HALF_OPEN
    breaker.on_success(breaker.on_dispatch())
    assert reported(breaker) is BreakerState.CLOSED


def test_an_abandoned_trial_frees_the_slot() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=1.0, clock=clock)
    fail(breaker)
    clock.now = 1.0
    assert breaker.allows()
    trial = breaker.on_dispatch()
    assert not breaker.allows()
    breaker.on_abandoned(trial)
    assert breaker.allows()


def test_cooldown_is_capped() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=1.0, max_cooldown_s=2.0, clock=clock)
    fail(breaker)
    for _ in range(5):  # every trial fails
        clock.now += 10
        assert breaker.allows()
        fail(breaker)
    clock.now += 2.0
    assert breaker.allows()


def test_requests_sent_before_the_circuit_opened_do_not_move_it() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=1.0, clock=clock)
    early = [breaker.on_dispatch() for _ in range(4)]  # in flight when the worker breaks
    breaker.on_failure(early[0])
    breaker.on_failure(early[1])
    assert state(breaker) is BreakerState.OPEN
    breaker.on_success(early[2])  # it finished fine, but says nothing of the worker now
    assert state(breaker) is BreakerState.OPEN and not breaker.allows()
    clock.now = 1.0
    assert breaker.allows()
    trial = breaker.on_dispatch()
    breaker.on_failure(early[3])  # a late failure does not fail the trial
    breaker.on_abandoned(early[3])  # nor frees its slot
    assert state(breaker) is BreakerState.HALF_OPEN and not breaker.allows()
    breaker.on_success(trial)
    assert state(breaker) is BreakerState.CLOSED


async def test_a_worker_failing_fast_is_cut_off_then_readmitted(
    engine_factory: EngineFactory,
) -> None:
    health = HealthConfig(interval_s=60, failure_threshold=3, cooldown_s=0.3)
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet, policy="least_load", health=health)) as router,
        aiohttp.ClientSession() as http,
    ):
        await set_faults(http, fleet[0], fail_requests=True)  # /health still answers 200
        body = chat_body([{"role": "user", "content": "hi"}], max_tokens=2)
        for _ in range(20):
            result = await post(http, router.url, body)
            assert result.status == 200 and result.worker == "w1"
        # Idle and failing fast, w0 would win every least-load pick: only the breaker
        # keeps it to its threshold of failed attempts.
        assert await metric(http, router, "kvrouter_retries_total") == 3
        # Open, or half-open if its cooldown has passed meanwhile: not closed.
        assert await metric(http, router, "kvrouter_worker_circuit_state", worker="w0") in (1, 2)

        await set_faults(http, fleet[0], fail_requests=False)

        async def reported_half_open() -> bool:  # with no request coming to try it
            state = await metric(http, router, "kvrouter_worker_circuit_state", worker="w0")
            return state == 1

        await wait_for(reported_half_open, timeout_s=5)

        async def readmitted() -> bool:
            result = await post(http, router.url, body)
            return result.status == 200 and result.worker == "w0"

        await wait_for(readmitted, timeout_s=5)
        assert await metric(http, router, "kvrouter_worker_circuit_state", worker="w0") == 0
