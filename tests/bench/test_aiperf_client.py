"""aiperf 0.13 itself as an outside client: its multi-turn mode through the router to
simulated engines. The router knows each of aiperf's conversations by its
X-Session-Affinity header, keeps every later turn on the engine that holds the turn
before it, and aiperf's own export has a TTFT for every request.

aiperf runs from ``scripts/install-aiperf.sh``'s environment, which ``scripts/test.sh``
installs; without it this test is skipped."""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise
from pathlib import Path

import aiohttp
import pytest
import xxhash

from bench.aiperf.client import AiperfRun, log_tail, run_aiperf
from bench.aiperf.environment import install_aiperf, installed_aiperf
from bench.aiperf.export import AiperfRecord, read_records, read_ttft
from bench.aiperf.hf_cache import hub_cache_home, offline_environment
from bench.aiperf.sessions import SessionShape, session_id, write_sessions
from router.apis.sessions import NO_SESSION
from router.wire.sessions import DEFAULT_SESSION_KEYS
from tests.conftest import TEST_MODEL, EngineFactory, router_config, serve_router
from tests.router_client import BLOCK, engines, metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="session")
def aiperf() -> Path:
    """aiperf's executable, installed on first use as the real engines' vLLM is
    (scripts/install-aiperf.sh; scripts/test.sh runs it before the suite)."""
    return installed_aiperf() or install_aiperf()


SHAPE = SessionShape(
    sessions=3, turns=3, system_tokens=200, user_tokens=100, output_tokens=16, key="test"
)
AIPERF_TIMEOUT_S = 150.0


def session_key(correlation_id: str) -> str:
    """The router's session key for a header value (router.apis.sessions)."""
    return xxhash.xxh3_128_hexdigest(correlation_id.encode())


def by_conversation(records: list[AiperfRecord]) -> dict[str, list[AiperfRecord]]:
    grouped: dict[str, list[AiperfRecord]] = defaultdict(list)
    for record in sorted(records, key=lambda r: (r.conversation, r.turn)):
        grouped[record.conversation].append(record)
    return grouped


async def test_aiperf_multi_turn_sessions_through_the_router(
    aiperf: Path, engine_factory: EngineFactory, model_dir: Path, tmp_path: Path
) -> None:
    dataset = write_sessions(SHAPE, tmp_path / "sessions.jsonl")
    env = offline_environment(hub_cache_home(model_dir, tmp_path / "hf"))
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet)) as router,
        aiohttp.ClientSession() as http,
    ):
        run = AiperfRun(
            url=router.url,
            model=TEST_MODEL,
            input_file=dataset,
            conversations=SHAPE.sessions,
            concurrency=SHAPE.sessions,
            artifact_dir=tmp_path / "aiperf",
            workers=1,  # fewer processes to start on a small machine
        )
        status = await run_aiperf(aiperf, run, env, AIPERF_TIMEOUT_S)
        assert status == 0, log_tail(run)
        sources = {
            source: await metric(http, router, "kvrouter_session_keys_total", source=source)
            for source in (*DEFAULT_SESSION_KEYS, NO_SESSION)
        }
        engine_cached = await metric(http, router, "kvrouter_engine_cached_tokens_total")
        engine_prompted = await metric(http, router, "kvrouter_usage_prompt_tokens_total")
        remembered = router.state.router.learner.sessions

    records = read_records(run.artifact_dir)
    # aiperf's own figures: every turn of every conversation, each with a TTFT.
    conversations = by_conversation(records)
    assert sorted(conversations) == [session_id(i) for i in range(SHAPE.sessions)]
    for turns in conversations.values():
        assert [r.turn for r in turns] == list(range(SHAPE.turns))
    assert [r.error for r in records if r.error is not None] == []
    assert all(r.ttft_ms is not None and r.ttft_ms > 0 for r in records)
    assert read_ttft(run.artifact_dir).count == SHAPE.requests

    # One session id per conversation, the same on each of its turns, and the router
    # read it from X-Session-Affinity on every request.
    ids = {name: {r.correlation_id for r in turns} for name, turns in conversations.items()}
    assert all(len(one) == 1 for one in ids.values())
    keys = {session_key(next(iter(one))) for one in ids.values()}
    assert len(keys) == SHAPE.sessions
    assert sources == {
        **dict.fromkeys((*DEFAULT_SESSION_KEYS, NO_SESSION), 0.0),
        "header:x-session-affinity": float(SHAPE.requests),
    }
    assert len(remembered) == SHAPE.sessions
    assert all(remembered.get(key) is not None for key in keys)

    # The engines' hit rate: nothing cached for a first turn (no two conversations share
    # a block), and each later turn found at least the whole blocks of the turn before.
    for turns in conversations.values():
        assert turns[0].cached_tokens == 0
        for before, after in pairwise(turns):
            assert before.prompt_tokens is not None and after.cached_tokens is not None
            assert after.cached_tokens > before.prompt_tokens - BLOCK, (before, after)
    # aiperf and the router read the same usage: the router's hit rate is aiperf's.
    assert engine_cached == sum(r.cached_tokens or 0 for r in records) > 0
    assert engine_prompted == sum(r.prompt_tokens or 0 for r in records)
