"""Running a parsed request on the engine, for every API that takes the chat or
completion path (OpenAI's, Anthropic's Messages, OpenAI's Responses)."""

from __future__ import annotations

from bench.sim.engine import Engine
from bench.sim.exchange import Exchange
from bench.sim.openai_api import ParsedRequest
from bench.sim.request import SimRequest
from bench.sim.request_fields import ApiError


def raise_injected_fault(engine: Engine) -> None:
    """``fail_requests`` (``POST /sim/faults``): the request fails as the engine's would."""
    faults = engine.faults.state
    if faults.fail_requests:
        raise ApiError(faults.fail_status, "simulated engine failure (fault injected)")


def submit(engine: Engine, parsed: ParsedRequest, exchange: Exchange) -> SimRequest:
    return engine.submit(
        parsed.prompt,
        parsed.max_tokens,
        parsed.exact_length,
        parsed.seed,
        parsed.cache_salt,
        exchange.request_id(),
    )


async def finished(sim: SimRequest) -> SimRequest:
    while not sim.finished:
        await sim.next_update()
    if sim.dropped:
        raise ConnectionResetError("engine restarted")
    return sim
