"""The ttft policy and the engines' CPU tiers: a CPU-tier hit priced by its reload when
credited (``count_offloaded``), a reload onto a full GPU a tie (``spread_reloads``), and
a dispatch's prefill as its policy priced it."""

from __future__ import annotations

import pytest

from policies.base import WorkerView
from policies.ttft import TtftParams, TtftPolicy, estimate_ttft
from router.fleet.workers import Worker
from router.routing.dispatch import Choice
from router.routing.policy_slot import ActivePolicy
from tests.routing.test_policies import request, worker

CREDITED = TtftParams(count_offloaded=True)


def offloading(
    name: str, matched: int, offloaded: int, reload_rate: float, queued: int = 0
) -> WorkerView:
    return worker(name, matched=matched)._replace(
        offloaded_tokens=offloaded, reload_tokens_per_s=reload_rate, queued_prefill_tokens=queued
    )


def test_ttft_prices_a_cpu_tier_hit_by_its_reload() -> None:
    """20,000 tokens of history: the worker that held them on its GPU is busy (40,000
    tokens queued, 4 s); another holds them in its CPU tier (0.4 s to read back at
    50,000 tokens/s); a third holds nothing (2 s of prefill)."""
    policy = TtftPolicy(CREDITED)
    busy = offloading("gpu", 20_000, 0, 50_000.0, queued=40_000)
    cpu = offloading("cpu", 0, 20_000, 50_000.0)
    cold = offloading("cold", 0, 0, 50_000.0)
    decision = policy.choose(request(prompt_tokens=20_500), [busy, cpu, cold])
    assert (decision.worker, decision.reason, decision.predicted_cached_tokens) == (
        "cpu",
        "prefix",
        20_000,
    )
    estimates = [estimate_ttft(v, 20_500, CREDITED) for v in (busy, cpu, cold)]
    assert estimates == [pytest.approx(4.05), pytest.approx(0.05 + 0.4), pytest.approx(2.05)]


@pytest.mark.parametrize(
    ("params", "reload_rate"),
    [(TtftParams(), 50_000.0), (CREDITED, 0.0)],
)
def test_a_cpu_tier_hit_is_not_credited_when_told_not_to_or_its_price_is_unknown(
    params: TtftParams, reload_rate: float
) -> None:
    cpu = offloading("cpu", 0, 20_000, reload_rate)
    cold = offloading("cold", 0, 0, reload_rate)._replace(resident_tokens=0)
    decision = TtftPolicy(params, seed=1).choose(request(prompt_tokens=20_500), [cpu, cold])
    assert decision.predicted_cached_tokens == 0
    assert estimate_ttft(cpu, 20_500, params) == estimate_ttft(cold, 20_500, params)


def test_a_reload_slower_than_prefill_loses_to_a_cold_worker() -> None:
    slow_link = offloading("cpu", 0, 20_000, 5_000.0)  # 4 s to read back, 2 s to compute
    cold = offloading("cold", 0, 0, 5_000.0)
    policy = TtftPolicy(CREDITED)
    assert policy.choose(request(prompt_tokens=20_500), [slow_link, cold]).worker == "cold"


@pytest.mark.parametrize(("credited", "expected"), [(True, 500), (False, 20_500)])
def test_a_dispatch_counts_as_prefill_what_its_policy_did_not_credit(
    credited: bool, expected: int
) -> None:
    """The queued prefill a dispatch adds to its worker is what the policy priced: a
    CPU-tier hit it credited is read back, one it did not (blind to the tier) computed.
    Before, every CPU-tier hit was taken off, whatever the policy saw."""
    params = TtftParams(count_offloaded=credited)
    cpu = offloading("cpu", 0, 20_000, 50_000.0)
    route = request(prompt_tokens=20_500)
    decision = TtftPolicy(params).choose(route, [cpu])
    policy = ActivePolicy("ttft", {}, 0, TtftPolicy(params))
    worker = Worker("cpu", "http://127.0.0.1:1", 100_000)
    choice = Choice(policy, route, worker, decision, 0, 0, 0.0, 20_000)
    assert choice.prefill_tokens == expected


@pytest.mark.parametrize(("spread", "expected"), [(True, "cold"), (False, "cpu")])
def test_a_reload_onto_a_full_gpu_is_a_tie_the_least_busy_worker_takes(
    spread: bool, expected: str
) -> None:
    """Both caches full: the worker holding the session in its CPU tier (recently sent
    much) ties with a cold one (sent little), which takes the turn; without
    spread_reloads the reload's saving decides alone."""
    params = TtftParams(count_offloaded=True, spread_reloads=spread)
    cpu = offloading("cpu", 0, 20_000, 50_000.0)._replace(
        resident_tokens=100_000, recent_prompt_tokens=300_000
    )
    cold = offloading("cold", 0, 0, 50_000.0)._replace(
        resident_tokens=100_000, recent_prompt_tokens=50_000
    )
    assert TtftPolicy(params).choose(request(prompt_tokens=20_500), [cpu, cold]).worker == expected


def test_a_reload_onto_a_gpu_with_room_goes_to_its_holder() -> None:
    cpu = offloading("cpu", 0, 20_000, 50_000.0)._replace(recent_prompt_tokens=300_000)
    cold = offloading("cold", 0, 0, 50_000.0)
    assert TtftPolicy(CREDITED).choose(request(prompt_tokens=20_500), [cpu, cold]).worker == "cpu"
