"""Trace replay: the oracle, the summary, the result file, compare, and a replay against
the real simulated engine on loopback."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from bench.loopback import serve_on_loopback
from bench.replay.client import retry_after_s
from bench.replay.compare import compare, run_labels
from bench.replay.oracle import PrefixOracle
from bench.replay.progress import ProgressDisplay
from bench.replay.result import (
    RequestRecord,
    ResultFormatError,
    RunMeta,
    RunResult,
    load_result,
    percentile,
    save_result,
    summarize,
)
from bench.replay.runner import ReplayConfig, replay, select_sessions
from bench.workloads.trace import TextBlock, Turn
from router.wire.blocks import TOKEN_BYTES
from tests.conftest import EngineFactory, router_config, serve_router
from tests.router_client import metric

BLOCK = 16


def _tokens(seed: int, count: int) -> bytes:
    """``count`` distinct stand-in tokens, different for each seed."""
    return b"".join((seed * 1_000_003 + i).to_bytes(TOKEN_BYTES, "little") for i in range(count))


def _record(
    turn: int,
    cached: int,
    oracle: int,
    prompt: int = 100,
    ttft: float | None = 0.1,
    error: str | None = None,
    start: float = 0.0,
    latency: float = 1.0,
    completion: int = 10,
) -> RequestRecord:
    return RequestRecord(
        session="s",
        turn=turn,
        start=start,
        ttft_s=ttft,
        latency_s=latency,
        prompt_tokens=prompt,
        cached_tokens=cached,
        oracle_cached_tokens=oracle,
        completion_tokens=completion,
        worker=None,
        error=error,
        status=200 if error is None else 500,
    )


# --- oracle ---------------------------------------------------------------------------


def test_oracle_hits_the_shared_whole_blocks() -> None:
    oracle = PrefixOracle(BLOCK)
    first = _tokens(1, 5 * BLOCK)
    second = first[: 3 * BLOCK * TOKEN_BYTES] + _tokens(2, 2 * BLOCK + 5)
    assert oracle.hit_tokens(first) == 0
    oracle.observe_prompt(first)
    assert oracle.hit_tokens(second) == 48


def test_oracle_leaves_the_last_prompt_token_to_compute() -> None:
    oracle = PrefixOracle(BLOCK)
    prompt = _tokens(1, 3 * BLOCK)
    oracle.observe_prompt(prompt)
    # All 48 tokens are known, but a hit stops at whole blocks within 47 tokens.
    assert oracle.hit_tokens(prompt) == 32
    longer = prompt + _tokens(2, 2)
    assert oracle.hit_tokens(longer) == 48


def test_oracle_stops_at_the_first_unknown_block() -> None:
    oracle = PrefixOracle(BLOCK)
    prompt = _tokens(1, 4 * BLOCK)
    oracle.observe_prompt(prompt)
    changed = bytearray(prompt)
    changed[BLOCK * TOKEN_BYTES] ^= 1  # a different second block: later blocks differ too
    assert oracle.hit_tokens(bytes(changed)) == 16


def test_oracle_completion_adds_reply_blocks_but_not_the_last_token() -> None:
    prompt, more = _tokens(1, 20), _tokens(3, 40)
    oracle = PrefixOracle(BLOCK)
    oracle.observe_prompt(prompt)
    reply = _tokens(2, 13)  # 33 tokens, 32 computed: two full blocks
    oracle.observe_completion(prompt, reply)
    assert oracle.hit_tokens(prompt + reply + more) == 32

    oracle = PrefixOracle(BLOCK)
    oracle.observe_prompt(prompt)
    short = _tokens(2, 12)  # 32 tokens, 31 computed: the second block is not full
    oracle.observe_completion(prompt, short)
    assert oracle.hit_tokens(prompt + short + more) == 16


# --- summary --------------------------------------------------------------------------


def test_percentile_interpolates_linearly() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([float(i) for i in range(1, 12)], 90) == pytest.approx(10.0)
    assert percentile([float(i) for i in range(101)], 99) == pytest.approx(99.0)


def test_summary_classifies_misses_and_counts_turn_zero_apart() -> None:
    records = [
        _record(0, cached=0, oracle=64, ttft=0.5),  # turn 0 under half: counted apart
        _record(0, cached=0, oracle=0, ttft=0.4),
        _record(1, cached=40, oracle=100, ttft=2.0),  # miss: 40 < 50
        _record(1, cached=50, oracle=100, ttft=0.2),  # exactly half: not a miss
        _record(2, cached=90, oracle=96, ttft=0.1),
        _record(2, cached=0, oracle=100, error="HTTP 500"),  # errors never count
    ]
    summary = summarize(records, duration_s=10.0)
    assert summary.requests == 6
    assert summary.errors == 1
    assert summary.turn0_requests == 2
    assert summary.turn0_missed == 1
    assert summary.later_requests == 3
    assert summary.missed_turns == 1
    assert summary.missed_share == pytest.approx(1 / 3)
    assert summary.missed_ttft_p50 == 2.0
    assert summary.prompt_tokens == 500
    assert summary.hit_rate == pytest.approx(180 / 500)
    assert summary.oracle_hit_rate == pytest.approx(360 / 500)
    assert summary.ttft_p50 == pytest.approx(0.4)
    assert summary.requests_per_s == pytest.approx(0.5)
    assert summary.output_tokens_per_s == pytest.approx(5.0)
    by_turn = {t.turn: t for t in summary.by_turn}
    assert sorted(by_turn) == [0, 1, 2]
    assert by_turn[1].requests == 2
    assert by_turn[1].hit_rate == pytest.approx(0.45)
    assert by_turn[2].oracle_hit_rate == pytest.approx(0.96)


def test_summary_duration_defaults_to_the_records_span() -> None:
    records = [_record(0, 0, 0, start=2.0, latency=1.0), _record(1, 0, 0, start=4.0, latency=2.0)]
    summary = summarize(records)
    assert summary.duration_s == pytest.approx(4.0)
    assert summary.requests_per_s == pytest.approx(0.5)
    empty = summarize([])
    assert (empty.requests, empty.hit_rate, empty.ttft_p99) == (0, 0.0, None)


# --- result file and compare ----------------------------------------------------------


def _result(records: list[RequestRecord], target: str = "http://x") -> RunResult:
    meta = RunMeta(
        target=target,
        trace="t.jsonl",
        model="m",
        time_scale=10.0,
        concurrency=4,
        started_at="2025-01-01T00:00:00+00:00",
        duration_s=12.5,
    )
    return RunResult(meta, tuple(records))


def test_goodput_counts_the_turns_within_the_ttft_objective() -> None:
    """Five turns of two sessions over 10 s, an objective of 0.5 s: the fast successful
    turns count; a slow one, a failed one and one without a first token do not."""
    records = [
        replace(_record(0, 0, 0, ttft=0.2), session="a"),
        replace(_record(1, 0, 0, ttft=0.4), session="a"),
        replace(_record(2, 0, 0, ttft=0.9), session="a"),
        replace(_record(0, 0, 0, ttft=0.1, error="boom"), session="b"),
        replace(_record(1, 0, 0, ttft=None), session="b"),
    ]
    summary = summarize(records, 10.0, slo_ttft_s=0.5)
    assert summary.slo_met_share == pytest.approx(2 / 5)
    assert summary.goodput_per_s == pytest.approx(0.2)
    assert summary.session_slo_met_median == pytest.approx((2 / 3 + 0) / 2)
    without = summarize(records, 10.0)
    assert without.goodput_per_s is None and without.slo_met_share is None


def test_the_wait_a_refusal_asks_for_is_read_as_the_sdks_read_it() -> None:
    assert retry_after_s({"retry-after-ms": "250", "Retry-After": "1"}) == 0.25
    assert retry_after_s({"retry-after-ms": "soon", "Retry-After": "3"}) == 3.0
    assert retry_after_s({"Retry-After": "1.5"}) == 1.5
    assert retry_after_s({"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}) is None
    # A number is taken whatever it is, as the SDKs take it (and then fall back to their
    # own backoff for one they do not wait for): not the next header.
    assert retry_after_s({"retry-after-ms": "-5", "Retry-After": "3"}) == -0.005
    assert retry_after_s({}) is None


def test_a_result_that_did_not_keep_retry_waits_times_only_turns_sent_once() -> None:
    once, retried = _record(0, cached=0, oracle=0), _record(1, cached=0, oracle=0)
    retried = dataclasses.replace(retried, attempts=2)
    assert once.retry_wait_s is None and once.served_ttft_s == once.ttft_s
    assert retried.served_ttft_s is None


def test_result_round_trips_through_json(tmp_path: Path) -> None:
    original = _result([_record(0, 0, 16, ttft=None), _record(1, 32, 48, error="boom")])
    path = tmp_path / "run.json"
    save_result(original, path)
    assert load_result(path) == original
    assert b'"simulated seconds' in path.read_bytes()
    with_objective = RunResult(replace(original.meta, slo_ttft_s=0.5), original.records)
    save_result(with_objective, path)
    assert load_result(path) == with_objective
    assert orjson.loads(path.read_bytes())["summary"]["slo_met_share"] == 0.0
    path.write_bytes(b'{"schema": "something else"}')
    with pytest.raises(ResultFormatError):
        load_result(path)


def test_compare_prints_both_runs_and_writes_plots(tmp_path: Path) -> None:
    a = _result([_record(0, 0, 0, ttft=0.3), _record(1, 80, 96, ttft=0.05)])
    b = _result([_record(0, 0, 0, ttft=0.4), _record(1, 10, 96, ttft=0.9)])
    labels = run_labels([Path("cache_aware.json"), Path("round_robin.json")], None)
    out = io.StringIO()
    written = compare([a, b], labels, Console(file=out, width=160), tmp_path / "plots")
    text = out.getvalue()
    assert "cache_aware" in text
    assert "round_robin" in text
    assert len(written) == 2
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="labels"):
        run_labels([Path("a.json")], ["x", "y"])


# --- end to end against the simulated engine ------------------------------------------

TIME_SCALE = 50.0


@pytest.fixture
async def engine_url(engine_factory: EngineFactory) -> AsyncIterator[str]:
    """A simulated engine (tests/conftest.py) running TIME_SCALE times real time."""
    async with engine_factory(time_scale=TIME_SCALE) as running:
        yield running.url


def _tiny_trace() -> list[Turn]:
    system = (TextBlock("shared-system", 120),)
    turns = []
    for index, session in enumerate(("alpha", "beta")):
        for turn in range(3):
            turns.append(
                Turn(
                    session=session,
                    turn=turn,
                    arrival=index * 1.0,
                    gap=0.0 if turn == 0 else 1.0,
                    user=(TextBlock(f"{session}-user-{turn}", 40 + 7 * turn),),
                    output_tokens=24,
                    system=system if turn == 0 else None,
                )
            )
    return turns


async def _prefix_cache_hits(url: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:prefix_cache_hits_total"
    )


async def test_replay_against_the_simulated_engine(engine_url: str) -> None:
    config = ReplayConfig(
        target=engine_url, trace=Path("tiny.jsonl"), concurrency=4, time_scale=TIME_SCALE
    )
    seen: list[RequestRecord] = []
    result = await replay(config, select_sessions(_tiny_trace()), seen.append)

    assert result.meta.model == "sim-model"
    assert len(result.records) == 6
    assert len(seen) == 6
    assert [r.error for r in result.records] == [None] * 6
    for record in result.records:
        assert record.status == 200
        assert record.completion_tokens == 24
        assert record.ttft_s is not None
        assert 0 < record.ttft_s <= record.latency_s
        # Nothing the engine hits can be unknown to the oracle.
        assert record.cached_tokens <= record.oracle_cached_tokens
        if record.turn > 0:
            assert record.cached_tokens > 0
            # One engine with room to spare holds everything the session sent before.
            assert record.cached_tokens == record.oracle_cached_tokens
    assert sum(r.cached_tokens for r in result.records) == await _prefix_cache_hits(engine_url)
    summary = summarize(result.records, result.meta.duration_s)
    assert summary.missed_turns == 0
    assert summary.hit_rate > 0.5


async def test_an_agent_session_calls_its_tools_and_sends_their_results(
    engine_factory: EngineFactory,
) -> None:
    """Turns that end in a tool call ask for one (tools offered on every turn, the call
    required); the next turn answers it with a ``tool`` message after the assistant's
    call, so the engine still finds the whole conversation cached; the router reads the
    calls from the replies and the sessions' returns from the next turns."""
    trace = [
        replace(t, ended_by="tool" if t.turn < 2 else "user")
        for t in _tiny_trace()
        if t.session == "alpha"
    ]
    async with (
        engine_factory(time_scale=TIME_SCALE) as engine,
        serve_router(router_config([engine])) as router,
    ):
        config = ReplayConfig(target=router.url, trace=Path("t.jsonl"), time_scale=TIME_SCALE)
        result = await replay(config, select_sessions(trace))
        async with aiohttp.ClientSession() as http:
            ends = await metric(http, router, "kvrouter_session_turn_ends_total", waiting_on="tool")
            name = "kvrouter_session_return_seconds_count"
            back = await metric(http, router, name, after="tool")
    assert [r.error for r in result.records] == [None] * 3
    assert (ends, back) == (2, 2)
    for record in result.records[1:]:
        assert 0 < record.cached_tokens == record.oracle_cached_tokens
    # The call is written back as it was generated: the next turn hits past the prompt.
    first, second = result.records[0], result.records[1]
    assert second.cached_tokens > first.prompt_tokens
    assert [r.after for r in result.records] == [None, "tool", "tool"]
    summary = summarize(result.records)
    assert summary.after_tool_requests == 2
    low, high = sorted(r.ttft_s or 0.0 for r in result.records[1:])
    assert low > 0
    assert summary.after_tool_ttft_p99 == pytest.approx(low + 0.99 * (high - low))


async def test_failed_requests_are_recorded_and_sessions_go_on(engine_url: str) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{engine_url}/sim/faults", json={"fail_requests": True, "fail_status": 503}
        ) as resp,
    ):
        assert resp.status == 200
    config = ReplayConfig(
        target=engine_url, trace=Path("tiny.jsonl"), model="sim-model", time_scale=TIME_SCALE
    )
    result = await replay(config, select_sessions(_tiny_trace(), max_sessions=1))
    assert [(r.turn, r.status) for r in result.records] == [(0, 503), (1, 503), (2, 503)]
    assert all(r.error is not None and "503" in r.error for r in result.records)
    assert summarize(result.records).errors == 3


async def test_unreachable_target_is_an_error_per_request() -> None:
    # A port nothing listens on: bind a server, note its port, close it.
    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    await runner.cleanup()
    config = ReplayConfig(
        target=f"http://127.0.0.1:{port}", trace=Path("t"), model="m", time_scale=TIME_SCALE
    )
    result = await replay(config, select_sessions(_tiny_trace(), max_sessions=1))
    assert len(result.records) == 3
    assert all(r.status == 0 and r.error for r in result.records)


async def _error_stream(request: web.Request) -> web.StreamResponse:
    """A worker behind a router that dies mid-reply: one token, then an error event."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "x-kvrouter-worker": "worker-1"}
    )
    await response.prepare(request)
    await response.write(b'data: {"choices": [{"index": 0, "delta": {"content": "abcd"}}]}\n\n')
    await response.write(b'data: {"error": {"message": "boom", "code": 500}}\n\n')
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def test_an_error_event_in_the_stream_fails_the_request() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _error_stream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        config = ReplayConfig(
            target=f"http://127.0.0.1:{runner.addresses[0][1]}",
            trace=Path("t"),
            model="m",
            time_scale=TIME_SCALE,
        )
        result = await replay(config, select_sessions(_tiny_trace(), max_sessions=1))
    finally:
        await runner.cleanup()
    assert [r.turn for r in result.records] == [0, 1, 2]
    for record in result.records:
        assert record.status == 200
        assert record.worker == "worker-1"
        assert record.error == "stream error: boom"
        assert record.ttft_s is not None


async def test_progress_prints_a_status_line_when_not_on_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=120)
    async with ProgressDisplay(2, console, status_interval_s=3600) as display:
        display.add(_record(0, cached=25, oracle=50))
        display.add(_record(1, cached=0, oracle=0, error="HTTP 500"))
    assert out.getvalue().strip() == "replay 2/2 requests  hit  25.0% (oracle  50.0%)  errors 1"


async def test_a_refused_turn_is_sent_again_as_the_sdks_do_and_a_session_gives_up() -> None:
    """An endpoint that refuses the first two sends of every turn with 429 (its
    retry-after-ms taken as it is, before its whole-second Retry-After, as the SDKs do),
    then answers: with two retries every turn gets through on its third send, its TTFT
    counted from the first; with one, the first turn is refused twice and its session
    gives up. Without retries each refusal is a failed turn and the session goes on.
    At time scale 2 every wait counts twice, in simulated seconds."""
    sends: dict[str, int] = {}

    async def refusing_twice(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        key = body["messages"][-1]["content"]
        sends[key] = sends.get(key, 0) + 1
        if sends[key] <= 2:
            return web.json_response(
                {"error": {"message": "busy"}},
                status=429,
                headers={"Retry-After": "2", "retry-after-ms": "50"},
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"index": 0, "delta": {"content": "ok"}}]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", refusing_twice)
    results = {}
    async with serve_on_loopback(app) as url:
        for retries in (2, 1, 0):
            sends.clear()
            config = ReplayConfig(
                target=url, trace=Path("t"), model="m", time_scale=2.0, retries=retries
            )
            results[retries] = await replay(config, select_sessions(_tiny_trace(), max_sessions=1))
    through = results[2].records
    assert [(r.attempts, r.error, r.gave_up) for r in through] == [(3, None, False)] * 3
    # Two waits of 50 ms (retry-after-ms), not of 2 s (Retry-After), counted twice.
    assert all((r.ttft_s or 0) >= 0.2 for r in through)
    assert all(0.2 <= (r.retry_wait_s or 0) < 8 for r in through)
    # The attempt served is timed from its own send: the waits before it left out.
    served = [r.served_ttft_s for r in through]
    summary = summarize(through)
    assert summary.served_ttft_p99 == percentile([t for t in served if t], 99)
    assert summary.ttft_p99 is not None
    assert summary.ttft_p99 - (summary.served_ttft_p99 or 0) >= 0.2
    assert summary.retries == 6
    gave_up = results[1].records
    assert [(r.turn, r.attempts, r.status, r.gave_up) for r in gave_up] == [(0, 2, 429, True)]
    assert summarize(gave_up).sessions_given_up == 1
    plain = results[0].records
    assert all(r.retry_wait_s == 0 and r.served_ttft_s == r.ttft_s for r in plain)
    assert [(r.turn, r.status, r.attempts) for r in plain] == [
        (0, 429, 1),
        (1, 429, 1),
        (2, 429, 1),
    ]
