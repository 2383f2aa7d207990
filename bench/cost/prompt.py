"""The cost of routing one long prompt in-process: ``parse_request`` (read the body,
canonicalize, hash its prefix blocks), ``Router.route_request`` and ``Router.dispatch``
(look the blocks up on every worker, let the policy choose, reserve), timed together
and one by one, median of ``repeat``; beside them ``orjson.loads`` of the same body,
which any router that reads the model name pays, and ``Dispatch.finish``, which runs
when the reply has been relayed (it records the prompt's blocks on the worker).

After the first request the prompt is cached on the workers it was sent to, as a
session's repeated context would be: these are the costs of a long prompt seen before.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from bench.textgen import text_for
from router.apis.request import ClientRequest, parse_request
from router.apis.sessions import SessionSources
from router.config import DEFAULT_KV_TOKENS, RouterConfig
from router.fleet.workers import Fleet, Worker
from router.index.residency import LocalPrefixIndex
from router.observability.metrics import RouterMetrics
from router.routing.dispatch import EngineUsage, Router
from router.routing.membership import Membership
from router.routing.policy_slot import PolicySlot

SYSTEM_TOKENS = 4_000


@dataclass(frozen=True, slots=True)
class PromptCost:
    """Medians in seconds."""

    policy: str
    prompt_tokens: int
    body_bytes: int
    blocks: int
    orjson_s: float
    parse_s: float
    route_s: float
    dispatch_s: float
    total_s: float  # parse + route + dispatch, timed as one
    finish_s: float


def long_body(tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": text_for("sys", SYSTEM_TOKENS)},
                {"role": "user", "content": text_for("user", max(0, tokens - SYSTEM_TOKENS))},
            ],
        }
    )


def _median_time(fn: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def prompt_cost(
    policy: str, tokens: int = 100_000, workers: int = 4, repeat: int = 30
) -> PromptCost:
    config = RouterConfig(policy=policy)
    block_bytes, block_tokens = config.prefix.key_block_bytes, config.prefix.block_tokens
    sources, limits = SessionSources(config.session_keys), config.limits
    body = long_body(tokens)
    fleet, index = Fleet(), LocalPrefixIndex()
    metrics = RouterMetrics(fleet, index, block_tokens)
    router = Router(fleet, index, PolicySlot(policy, {}, 0, metrics), block_tokens, metrics)
    membership = Membership(fleet, index, metrics, router.learner, block_tokens)
    for w in range(workers):
        membership.add(Worker(f"w{w}", f"http://w{w}", DEFAULT_KV_TOKENS))

    def parse() -> ClientRequest:
        return parse_request("chat", body, block_bytes, sources=sources, limits=limits)

    request = parse_request("chat", body, block_bytes, sources=sources, limits=limits)
    route = router.route_request(request, "r")
    totals, finishes, dispatches = [], [], []
    for i in range(repeat):
        start = time.perf_counter()
        parsed = parse()
        routed = router.route_request(parsed, f"r{i}")
        dispatch = router.dispatch(parsed, routed, [])
        totals.append(time.perf_counter() - start)
        start = time.perf_counter()
        dispatch.first_byte()
        dispatch.finish("success", (), EngineUsage(routed.prompt_tokens, 0))
        finishes.append(time.perf_counter() - start)
        start = time.perf_counter()
        again = router.dispatch(request, route, [])
        dispatches.append(time.perf_counter() - start)
        again.fail("upstream_error")
    return PromptCost(
        policy=policy,
        prompt_tokens=tokens,
        body_bytes=len(body),
        blocks=len(request.key.hashes),
        orjson_s=_median_time(lambda: orjson.loads(body), repeat),
        parse_s=_median_time(parse, repeat),
        route_s=_median_time(lambda: router.route_request(request, "r"), repeat),
        dispatch_s=statistics.median(dispatches),
        total_s=statistics.median(totals),
        finish_s=statistics.median(finishes),
    )
