"""Routing policies with plain values: no server, no router."""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import get_args

import orjson
import pytest

from policies.base import REASONS, PolicyConfigError, Reason, RouteRequest, WorkerView
from policies.cache_aware import CacheAwarePolicy
from policies.least_load import LeastLoadPolicy
from policies.power_of_two import PowerOfTwoPolicy
from policies.random_choice import RandomPolicy
from policies.registry import (
    PolicyClass,
    PolicyRegistry,
    build_policy,
    policy_class,
    policy_knobs,
    policy_names,
)
from policies.round_robin import RoundRobinPolicy
from policies.session import SessionPolicy
from router.apis.request import parse_request

# Assigning the classes to the registry's protocol makes mypy check they fit it.
WRITTEN: tuple[PolicyClass, ...] = (
    RoundRobinPolicy,
    RandomPolicy,
    LeastLoadPolicy,
    PowerOfTwoPolicy,
    SessionPolicy,
    CacheAwarePolicy,
)


def request(session: str | None = None, prompt_tokens: int = 1000) -> RouteRequest:
    return RouteRequest(
        request_id="r1",
        model="m",
        session_key=session,
        block_hashes=(1, 2, 3),
        block_tokens=16,
        prompt_tokens=prompt_tokens,
    )


def worker(
    name: str, requests: int = 0, tokens: int = 0, matched: int = 0, resident: int = 0
) -> WorkerView:
    return WorkerView(
        name=name,
        outstanding_requests=requests,
        outstanding_tokens=tokens,
        queued_prefill_tokens=0,
        matched_tokens=matched,
        resident_tokens=resident,
        capacity_tokens=100_000,
        prefill_tokens_per_s=10_000.0,
    )


def idle(*names: str) -> list[WorkerView]:
    return [worker(n) for n in names]


AVAILABLE = policy_names()
WRITTEN_NAMES = {c.name for c in WRITTEN}

# --- registry ------------------------------------------------------------------------


def test_registry_has_the_written_policies() -> None:
    assert set(policy_names()) >= WRITTEN_NAMES | {"ttft"}
    for cls in WRITTEN:
        assert policy_class(cls.name) is cls


def test_reasons_are_the_reason_literal() -> None:
    assert get_args(Reason) == REASONS
    assert len(set(REASONS)) == len(REASONS)


NEW_POLICY = """
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from policies.base import Decision, Policy, RouteRequest, WorkerView
from policies.round_robin import RoundRobinPolicy


@dataclass(frozen=True, slots=True)
class FastestParams:
    spread: float = 0.5
    mode: str = "fast"

    def __post_init__(self) -> None:
        if self.spread < 0:
            raise ValueError(f"spread must be >= 0, got {self.spread}")


class FastestPolicy(Policy):
    name: ClassVar[str] = "fastest"
    params_type: ClassVar[type[FastestParams]] = FastestParams

    def __init__(self, params: FastestParams, *, seed: int | None = None) -> None:
        self.params = params
        self.seed = seed
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> Decision:
        return Decision(self._rng.choice(candidates).name, "random")


class Imported(RoundRobinPolicy):
    "Inherits round_robin's name: not a second round_robin."
"""


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty package ``extra_policies`` on the path, forgotten after the test."""
    root = tmp_path / "extra_policies"
    root.mkdir()
    (root / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [m for m in sys.modules if m.partition(".")[0] == "extra_policies"]:
        del sys.modules[name]


def test_a_new_policy_module_is_found_by_name_with_its_knobs(package: Path) -> None:
    (package / "fastest.py").write_text(NEW_POLICY)
    registry = PolicyRegistry("extra_policies")
    assert registry.names() == ["fastest"]
    assert registry.knobs("fastest") == {"spread": 0.5, "mode": "fast"}
    policy = registry.build("fastest", {"spread": 2}, seed=9)
    assert getattr(policy, "params", None) == registry.policy_class("fastest").params_type(2)
    assert getattr(policy, "seed", None) == 9
    assert policy.choose(request(), idle("a", "b")).reason == "random"
    with pytest.raises(PolicyConfigError, match="no knob 'sprad'; knobs: mode, spread"):
        registry.build("fastest", {"sprad": 1.0})
    with pytest.raises(PolicyConfigError, match="spread must be a number, got 'wide'"):
        registry.build("fastest", {"spread": "wide"})
    with pytest.raises(PolicyConfigError, match="mode must be a string, got 3"):
        registry.build("fastest", {"mode": 3})
    with pytest.raises(PolicyConfigError, match="spread must be >= 0"):
        registry.build("fastest", {"spread": -1})
    with pytest.raises(
        PolicyConfigError, match="unknown policy 'slowest'; known policies: fastest"
    ):
        registry.build("slowest")


def test_a_policy_module_that_fails_to_import_is_named(package: Path) -> None:
    (package / "fastest.py").write_text(NEW_POLICY)
    (package / "broken.py").write_text("import no_such_module_for_kvrouter\n")
    with pytest.raises(ImportError, match=r"policy module extra_policies\.broken failed"):
        PolicyRegistry("extra_policies").names()


def test_two_policies_with_one_name_are_an_error(package: Path) -> None:
    (package / "fastest.py").write_text(NEW_POLICY)
    (package / "faster.py").write_text(NEW_POLICY)
    with pytest.raises(ImportError, match="'fastest' is defined twice"):
        PolicyRegistry("extra_policies").names()


@pytest.mark.parametrize("name", AVAILABLE)
def test_every_policy_builds_and_chooses_a_candidate(name: str) -> None:
    assert policy_class(name).name == name
    assert isinstance(policy_knobs(name), dict)
    policy = build_policy(name, seed=7)
    candidate_sets = [
        [worker("solo", requests=3)],
        [worker("a", 1, matched=900), worker("b", 0), worker("c", 5, resident=50)],
        [worker(f"w{i}", requests=i, tokens=100 * i, matched=16 * i) for i in range(8)],
    ]
    for candidates in candidate_sets:
        for session in (None, "s-1"):
            decision = policy.choose(request(session), candidates)
            assert decision.worker in {c.name for c in candidates}
            assert decision.reason in REASONS
            chosen = next(c for c in candidates if c.name == decision.worker)
            if name in WRITTEN_NAMES:  # these predict the chosen worker's modelled match
                assert decision.predicted_cached_tokens == chosen.matched_tokens


def test_unknown_policy_lists_known_names() -> None:
    with pytest.raises(PolicyConfigError) as info:
        build_policy("fastest")
    message = str(info.value)
    assert "'fastest'" in message
    for name in policy_names():
        assert name in message


def test_unknown_knob_names_it_and_lists_knobs() -> None:
    with pytest.raises(PolicyConfigError) as info:
        build_policy("cache_aware", {"cache_treshold": 0.4})
    message = str(info.value)
    assert "'cache_treshold'" in message
    for knob in (
        "balance_abs_threshold",
        "balance_rel_threshold",
        "cache_threshold",
        "low_match_target",
    ):
        assert knob in message


@pytest.mark.parametrize(
    ("name", "knobs"),
    [
        ("session", {"load_factor": 0.9}),
        ("least_load", {"token_weight": -1}),
        ("cache_aware", {"cache_threshold": 1.5}),
        ("cache_aware", {"low_match_target": "nearest"}),
    ],
)
def test_bad_knob_value_is_a_config_error(name: str, knobs: dict[str, object]) -> None:
    with pytest.raises(PolicyConfigError, match=next(iter(knobs))):
        build_policy(name, knobs)


def test_knobs_are_the_documented_defaults() -> None:
    assert policy_knobs("session") == {"load_factor": 1.25}
    assert policy_knobs("least_load") == {"token_weight": 0}
    assert policy_knobs("round_robin") == {}
    assert policy_knobs("cache_aware") == {
        "cache_threshold": 0.3,
        "balance_abs_threshold": 64,
        "balance_rel_threshold": 1.5,
        "low_match_target": "smallest_cache",
    }


def test_knobs_override_defaults() -> None:
    policy = build_policy("session", {"load_factor": 2.0})
    assert isinstance(policy, SessionPolicy)
    assert policy.params.load_factor == 2.0


# --- round robin, random --------------------------------------------------------------


def test_round_robin_cycles_in_name_order() -> None:
    policy = build_policy("round_robin")
    candidates = idle("c", "a", "b")
    picks = [policy.choose(request(), candidates).worker for _ in range(7)]
    assert picks == ["a", "b", "c", "a", "b", "c", "a"]
    assert policy.choose(request(), candidates).reason == "rotation"


def test_random_is_seeded_and_covers_candidates() -> None:
    candidates = idle("a", "b", "c", "d")

    def draws(seed: int) -> list[str]:
        policy = build_policy("random", seed=seed)
        return [policy.choose(request(), candidates).worker for _ in range(200)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)
    counts = Counter(draws(1))
    assert set(counts) == {"a", "b", "c", "d"}
    assert min(counts.values()) > 25  # uniform: 50 expected each


# --- least load, power of two -------------------------------------------------------


def test_least_load_picks_fewest_requests_then_tokens_then_name() -> None:
    policy = build_policy("least_load")
    assert policy.choose(request(), [worker("a", 3), worker("b", 1), worker("c", 2)]).worker == "b"
    tied = [worker("a", 2, tokens=900), worker("b", 2, tokens=100), worker("c", 5)]
    assert policy.choose(request(), tied).worker == "b"
    assert policy.choose(request(), [worker("b", 1, 10), worker("a", 1, 10)]).worker == "a"
    assert policy.choose(request(), tied).reason == "load"


def test_least_load_token_weight_counts_tokens_as_requests() -> None:
    candidates = [worker("a", 2, tokens=1000), worker("b", 1, tokens=50_000)]
    assert build_policy("least_load").choose(request(), candidates).worker == "b"
    # 4096 tokens weigh one request: a = 2 + 0.2, b = 1 + 12.2.
    weighted = build_policy("least_load", {"token_weight": 4096})
    assert weighted.choose(request(), candidates).worker == "a"


def test_power_of_two_with_two_always_takes_the_less_loaded() -> None:
    policy = build_policy("power_of_two", seed=3)
    candidates = [worker("busy", 9), worker("calm", 2)]
    assert {policy.choose(request(), candidates).worker for _ in range(500)} == {"calm"}


def test_power_of_two_samples_two_distinct_and_never_the_busiest() -> None:
    policy = build_policy("power_of_two", seed=11)
    candidates = [worker("w0", 0), worker("w1", 1), worker("w2", 2)]
    counts = Counter(policy.choose(request(), candidates).worker for _ in range(3000))
    # Pairs {w0,w1}, {w0,w2} -> w0 and {w1,w2} -> w1: 2/3 and 1/3, w2 never.
    assert set(counts) == {"w0", "w1"}
    assert 1800 < counts["w0"] < 2200


def test_power_of_two_single_candidate_is_only_choice() -> None:
    decision = build_policy("power_of_two", seed=0).choose(request(), [worker("x", 4)])
    assert (decision.worker, decision.reason) == ("x", "only_choice")


# --- session ----------------------------------------------------------------------------

KEYS = [f"session-{i}" for i in range(2000)]


def assignment(candidates: Sequence[WorkerView]) -> dict[str, str]:
    policy = build_policy("session")
    return {key: policy.choose(request(key), candidates).worker for key in KEYS}


def test_session_same_key_same_worker_and_keys_spread() -> None:
    policy = build_policy("session")
    candidates = idle("a", "b", "c", "d")
    first = policy.choose(request("abc"), candidates)
    assert first.reason == "session"
    for _ in range(5):
        assert policy.choose(request("abc"), list(reversed(candidates))) == first
    counts = Counter(assignment(candidates).values())
    assert set(counts) == {"a", "b", "c", "d"}
    assert all(400 < n < 600 for n in counts.values()), counts  # 500 expected


def test_session_removing_a_worker_moves_only_its_sessions() -> None:
    before = assignment(idle("a", "b", "c", "d"))
    after = assignment(idle("a", "b", "d"))
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == "c"}
    assert len({after[k] for k in moved}) == 3  # c's sessions spread over the rest


def test_session_adding_a_worker_moves_about_one_in_n() -> None:
    before = assignment(idle("a", "b", "c", "d"))
    after = assignment(idle("a", "b", "c", "d", "e"))
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "e" for k in moved)
    assert 0.15 < len(moved) / len(KEYS) < 0.25  # 1/5 expected


def test_session_bounded_load_diverts_to_the_next_ranked_worker() -> None:
    policy = build_policy("session")
    names = ("a", "b", "c", "d")
    preferred = policy.choose(request("hot"), idle(*names)).worker
    runner_up = policy.choose(request("hot"), idle(*(n for n in names if n != preferred)))
    # Others at 2 each: with the preferred at 3 the bound is ceil(1.25 * 10 / 4) = 4 and
    # 3 is under it; at 4 the bound is ceil(1.25 * 11 / 4) = 4 and 4 is not.
    under = [worker(n, 3 if n == preferred else 2) for n in names]
    decision = policy.choose(request("hot"), under)
    assert (decision.worker, decision.reason) == (preferred, "session")
    over = [worker(n, 4 if n == preferred else 2) for n in names]
    decision = policy.choose(request("hot"), over)
    assert (decision.worker, decision.reason) == (runner_up.worker, "load")


def test_session_without_key_is_least_load() -> None:
    decision = build_policy("session").choose(request(None), [worker("a", 4), worker("b", 1)])
    assert (decision.worker, decision.reason) == ("b", "load")


# --- cache aware ------------------------------------------------------------------------


def test_cache_aware_prefix_wins_when_balanced() -> None:
    policy = build_policy("cache_aware")
    candidates = [
        worker("a", 10, matched=200),
        worker("b", 12, matched=800),
        worker("c", 0, matched=0),
    ]
    decision = policy.choose(request(prompt_tokens=1000), candidates)
    assert (decision.worker, decision.reason) == ("b", "prefix")
    assert decision.predicted_cached_tokens == 800


def test_cache_aware_prefix_tie_goes_to_fewer_requests() -> None:
    candidates = [worker("a", 5, matched=800), worker("b", 2, matched=800)]
    assert build_policy("cache_aware").choose(request(), candidates).worker == "b"


# sgl-router's Rust thresholds (the launcher's defaults are 0.3 / 64 / 1.5).
RUST_DEFAULTS = {"cache_threshold": 0.5, "balance_abs_threshold": 32}


def test_cache_aware_imbalance_needs_both_thresholds() -> None:
    policy = build_policy("cache_aware", RUST_DEFAULTS)  # abs 32, rel 1.5
    hot = worker("hot", 40, matched=900)

    # 40 - 2 > 32 and 40 > 3: imbalanced, least loaded despite the prefix.
    decision = policy.choose(request(), [hot, worker("idle", 2)])
    assert (decision.worker, decision.reason) == ("idle", "load")
    # Spread exactly 32 is not over 32: balanced, the prefix wins.
    assert (
        policy.choose(request(), [worker("hot", 34, matched=900), worker("idle", 2)]).worker
        == "hot"
    )
    # Spread 33 > 32 but 103 is not over 70 * 1.5 = 105: balanced, the prefix wins.
    assert (
        policy.choose(request(), [worker("hot", 103, matched=900), worker("x", 70)]).worker == "hot"
    )
    # Spread 36 > 32 and 106 > 105: imbalanced.
    assert (
        policy.choose(request(), [worker("hot", 106, matched=900), worker("x", 70)]).worker == "x"
    )
    # Same loads, a higher abs threshold: balanced.
    lenient = build_policy("cache_aware", {**RUST_DEFAULTS, "balance_abs_threshold": 40})
    assert lenient.choose(request(), [hot, worker("idle", 2)]).worker == "hot"


def test_cache_aware_imbalance_ties_go_to_first_candidate() -> None:
    candidates = [worker("hot", 50), worker("y", 1), worker("x", 1)]
    assert build_policy("cache_aware").choose(request(), candidates).worker == "y"


def test_cache_aware_low_match_goes_to_smallest_cache() -> None:
    policy = build_policy("cache_aware", RUST_DEFAULTS)
    candidates = [
        worker("a", 1, matched=500, resident=9000),
        worker("b", 3, matched=0, resident=2000),
        worker("c", 0, matched=0, resident=5000),
    ]
    # 500 / 1000 is not over 0.5.
    decision = policy.choose(request(prompt_tokens=1000), candidates)
    assert (decision.worker, decision.reason) == ("b", "load")


def test_cache_aware_low_match_least_load_variant() -> None:
    policy = build_policy("cache_aware", {"low_match_target": "least_load"})
    candidates = [
        worker("a", 1, resident=9000),
        worker("b", 3, resident=2000),
        worker("c", 0, resident=5000),
    ]
    assert policy.choose(request(), candidates).worker == "c"


def test_cache_aware_empty_prompt_is_a_miss() -> None:
    candidates = [worker("a", 0, matched=0, resident=10), worker("b", 0, resident=5)]
    assert build_policy("cache_aware").choose(request(prompt_tokens=0), candidates).worker == "b"


def test_params_are_frozen() -> None:
    policy = build_policy("cache_aware")
    assert isinstance(policy, CacheAwarePolicy)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.params.cache_threshold = 0.1  # type: ignore[misc]


def _ttft_view(
    name: str,
    matched: int = 0,
    queued: int = 0,
    resident: int = 0,
    requests: int = 0,
    recent: float = 0.0,
    rate: float = 10_000.0,
) -> WorkerView:
    return WorkerView(
        name=name,
        outstanding_requests=requests,
        outstanding_tokens=0,
        queued_prefill_tokens=queued,
        matched_tokens=matched,
        resident_tokens=resident,
        capacity_tokens=100_000,
        prefill_tokens_per_s=rate,
        recent_prompt_tokens=recent,
    )


def test_ttft_sends_a_sibling_where_its_prompt_is_being_prefilled() -> None:
    """The second of two identical prompts: waiting for the first's prefill there, or
    prefilling alone on an idle worker, estimate the same give or take the partial last
    block; the worker that already holds the prompt computes it once."""
    policy = build_policy("ttft", seed=1)
    holder = _ttft_view("a", matched=3968, queued=4000, requests=1)
    chosen = policy.choose(request(prompt_tokens=4000), [holder, _ttft_view("b")])
    assert chosen.worker == "a" and chosen.reason == "prefix"
    strict = build_policy("ttft", {"tie_tolerance": 0.0}, seed=1)
    assert strict.choose(request(prompt_tokens=4000), [holder, _ttft_view("b")]).worker == "b"


def test_ttft_counts_what_a_request_evicts_from_a_full_cache() -> None:
    full = _ttft_view("full", resident=100_000)
    roomy_but_busy = _ttft_view("roomy", resident=50_000, queued=3_000)
    evicting = build_policy("ttft", {"eviction_weight": 1.0}, seed=1)
    assert evicting.choose(request(prompt_tokens=10_000), [full, roomy_but_busy]).worker == (
        "roomy"
    )  # 10K prefill + 10K evicted against 3K queued + 10K prefill
    blind = build_policy("ttft", seed=1)  # the default: what it evicts counts for nothing
    assert blind.choose(request(prompt_tokens=10_000), [full, roomy_but_busy]).worker == "full"


def test_ttft_spares_the_cache_whose_oldest_sessions_are_coming_back() -> None:
    """Both caches are full and this request pushes 10K tokens out of either; on "agents"
    they are sessions in a tool call, expected back, on "ended" conversations that are
    not. Priced by ``return_weight`` the placement goes where nothing is missed, even
    past a little more queued work; unpriced, the two are a tie settled by the queue."""
    agents = _ttft_view("agents", resident=100_000)._replace(returning_evicted_tokens=9_500)
    ended = _ttft_view("ended", resident=100_000, queued=2_000)._replace(
        returning_evicted_tokens=300
    )
    aware = build_policy("ttft", {"return_weight": 1.0, "tie_tolerance": 0.0}, seed=1)
    assert aware.choose(request(prompt_tokens=10_000), [agents, ended]).worker == "ended"
    blind = build_policy("ttft", {"tie_tolerance": 0.0}, seed=1)
    assert blind.choose(request(prompt_tokens=10_000), [agents, ended]).worker == "agents"


def test_ttft_ties_on_full_caches_spare_the_sessions_coming_back() -> None:
    """Two full caches, the same estimate: "agents" has less live context lately but its
    oldest sessions are in tool calls (30K tokens this request would push out, expected
    back); "ended" has more, but its oldest conversations are over. The tie goes where
    nobody is coming back for what is pushed out; without ``ties_spare_returns``, to the
    lesser live context."""
    agents = _ttft_view("agents", resident=100_000, recent=60_000)._replace(
        returning_evicted_tokens=30_000
    )
    ended = _ttft_view("ended", resident=100_000, recent=80_000)
    sparing = build_policy("ttft", {"ties_spare_returns": True}, seed=1)
    assert sparing.choose(request(prompt_tokens=4_000), [agents, ended]).worker == "ended"
    demand_only = build_policy("ttft", seed=1)  # the default
    assert demand_only.choose(request(prompt_tokens=4_000), [agents, ended]).worker == "agents"


def test_ttft_new_sessions_fill_the_emptier_cache_first() -> None:
    policy = build_policy("ttft", seed=1)
    views = [
        _ttft_view("a", resident=40_000),
        _ttft_view("b", resident=10_000),
        _ttft_view("c", resident=25_000),
    ]
    assert policy.choose(request(prompt_tokens=9_000), views).worker == "b"


def test_ttft_places_a_new_session_beside_the_least_live_context_once_caches_are_full() -> None:
    """After warm-up every cache is full of old sessions' blocks, so resident tokens tie;
    what was sent lately (the live sessions) tells the workers apart, in prefill seconds,
    so a slower worker with as much live context counts as busier."""
    policy = build_policy("ttft", seed=1)
    views = [
        _ttft_view("busy", resident=100_000, recent=300_000),
        _ttft_view("quiet", resident=100_000, recent=60_000),
        _ttft_view("fuller-but-quiet", resident=100_000, recent=90_000),
    ]
    assert policy.choose(request(prompt_tokens=4_000), views).worker == "quiet"
    slow = [
        _ttft_view("h100", resident=100_000, recent=90_000),
        _ttft_view("a100", resident=100_000, recent=80_000, rate=8_500.0),
    ]
    assert policy.choose(request(prompt_tokens=4_000), slow).worker == "h100"
    # Live context only breaks near-ties: a worker clearly faster to first token wins.
    queued = [
        _ttft_view("quiet-but-queued", resident=100_000, recent=0.0, queued=20_000),
        _ttft_view("busy-idle-now", resident=100_000, recent=300_000),
    ]
    assert policy.choose(request(prompt_tokens=4_000), queued).worker == "busy-idle-now"


def test_ttft_does_not_pin_every_new_session_to_the_worker_holding_a_shared_prefix() -> None:
    """Every session's prompt begins with the same 8K tokens, which one worker holds, and
    that worker's cache is full: a first turn is placed as if every worker held them (it
    pays their prefill once where they are not), a later turn follows its own history."""
    policy = build_policy("ttft", seed=1)
    views = [
        _ttft_view("holder", matched=8_000, resident=99_000, recent=200_000),
        _ttft_view("b", resident=8_000, recent=20_000),
        _ttft_view("c", resident=30_000, recent=20_000),
    ]
    first = request(prompt_tokens=9_500)._replace(first_turn=True)
    assert policy.choose(first, views).worker == "b"  # the emptier cache
    later = request(prompt_tokens=9_500)  # the same match, as a later turn's history
    assert policy.choose(later, views).worker == "holder"
    pinned = build_policy("ttft", {"spread_first_turns": False}, seed=1)
    assert pinned.choose(first, views).worker == "holder"
    # Still an estimate: a worker whose queue outweighs the shared prefix is not near.
    queued = [views[0], _ttft_view("b", resident=8_000, queued=20_000)]
    assert policy.choose(first, queued).worker == "holder"
    # While the holder has room, new sessions behind a shared system prompt stay with
    # it: nothing of anyone else's is given up for them.
    roomy = [views[0]._replace(resident_tokens=60_000), *views[1:]]
    assert policy.choose(first, roomy).worker == "holder"


@pytest.mark.parametrize(
    ("messages", "first"),
    [
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], True),
        ([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], False),
        (
            [
                {"role": "user", "content": "u"},
                {"role": "assistant", "tool_calls": []},
                {"role": "tool", "content": "r"},
            ],
            False,
        ),
    ],
)
def test_a_first_turn_is_a_conversation_with_no_reply_in_it(
    messages: list[dict[str, object]], first: bool
) -> None:
    raw = orjson.dumps({"model": "m", "messages": messages})
    assert parse_request("chat", raw, 64).first_turn is first
    completion = orjson.dumps({"model": "m", "prompt": "p"})
    assert parse_request("completion", completion, 64).first_turn is False
    follow_up = orjson.dumps({"model": "m", "input": "u", "previous_response_id": "resp_1"})
    assert parse_request("responses", follow_up, 64).first_turn is False


def test_ttft_keeps_a_repeated_first_turn_where_its_whole_prompt_is() -> None:
    """A first turn sent again (best-of-N, a retry) belongs where its whole prompt is,
    not spread as a new session over a shared prefix would be."""
    policy = build_policy("ttft", seed=1)
    holder = _ttft_view("holder", matched=9_488, resident=99_000)
    views = [holder, _ttft_view("b", resident=8_000), _ttft_view("c", resident=30_000)]
    again = request(prompt_tokens=9_500)._replace(first_turn=True)
    assert policy.choose(again, views).worker == "holder"
    # An engine holds whole blocks of its own size: 9,216 of 9,500 tokens in 512s.
    in_engine_blocks = [holder._replace(matched_tokens=9_216, cache_block_tokens=512), *views[1:]]
    assert policy.choose(again, in_engine_blocks).worker == "holder"
    new_session = [holder._replace(matched_tokens=8_000), *views[1:]]
    assert policy.choose(again, new_session).worker == "b"


def test_ttft_can_seat_a_subagent_beside_its_parent() -> None:
    """With subagents_with_parent, a subagent's first turn goes to its parent's worker
    when that worker is among the near-best; otherwise (the default) it is placed as any
    new session is."""
    views = [
        _ttft_view("parent", matched=4_000, resident=60_000),
        _ttft_view("b", matched=4_000, resident=8_000),
    ]
    child = request(prompt_tokens=5_000)._replace(first_turn=True, parent_worker="parent")
    assert build_policy("ttft", seed=1).choose(child, views).worker == "b"
    beside = build_policy("ttft", {"subagents_with_parent": True}, seed=1)
    assert beside.choose(child, views).worker == "parent"
    busy = [views[0]._replace(queued_prefill_tokens=50_000), views[1]]
    assert beside.choose(child, busy).worker == "b"  # a soft prior, not an order


def test_a_switch_knob_takes_true_or_false_only() -> None:
    for value in (0.5, 1, "false"):
        with pytest.raises(PolicyConfigError, match="true or false"):
            build_policy("ttft", {"spread_first_turns": value})
    assert build_policy("ttft", {"spread_first_turns": False}).params.spread_first_turns is False  # type: ignore[attr-defined]
