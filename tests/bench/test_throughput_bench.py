"""``kvrouter bench throughput``: the stand-in engine, the CPU reading, the namespace
check, the py-spy summary, and the rounds themselves for kvrouter with the Python load
generator (no peers, no wrk)."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web
from rich.console import Console

from bench import netns, proc_cpu
from bench.loopback import serve_on_loopback
from bench.ports import free_port_run
from bench.throughput import loadgen, standin
from bench.throughput.loadgen import LoadResult, RequestShape
from bench.throughput.pyspy import format_profile, summarize
from bench.throughput.report import Run, runs_table
from bench.throughput.run import ThroughputConfig, run_rounds, targets, with_policy
from router.fleet.health import read_engine_metrics


@pytest.fixture
async def standin_url() -> AsyncIterator[str]:
    servers = await standin.start_standin("127.0.0.1", [0])
    port = servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for server in servers:
            server.close()
            await server.wait_closed()


async def test_the_standin_answers_what_the_routers_ask(standin_url: str) -> None:
    async with aiohttp.ClientSession(standin_url) as http:
        async with http.get("/health") as reply:
            assert reply.status == 200
        async with http.get("/v1/models") as reply:
            assert [m["id"] for m in (await reply.json())["data"]] == [standin.MODEL]
        async with http.get("/metrics") as reply:
            assert read_engine_metrics(await reply.text()).capacity_tokens == standin.KV_TOKENS
        async with http.get("/get_server_info") as reply:
            assert (await reply.json())["max_total_num_tokens"] == standin.KV_TOKENS
        body = RequestShape(stream=False).body("1-1")
        async with http.post("/v1/chat/completions", data=body) as reply:
            whole = await reply.json()
        assert whole["choices"][0]["message"]["content"] == standin.REPLY_TEXT
        assert whole["usage"]["completion_tokens"] == standin.REPLY_TOKENS
        streamed = RequestShape(stream=True).body("1-2")
        async with http.post("/v1/chat/completions", data=streamed) as reply:
            assert reply.headers["Content-Type"] == "text/event-stream"
            events = [e for e in (await reply.text()).split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunks = [orjson.loads(e.removeprefix("data: ")) for e in events[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text.strip() == standin.REPLY_TEXT
        assert chunks[-1]["usage"]["completion_tokens"] == standin.REPLY_TOKENS

        async def chunked() -> AsyncIterator[bytes]:
            yield b'{"model": "m", "prompt": "ab'
            yield b'cd"}'

        async with http.post("/tokenize", data=chunked()) as reply:
            assert (await reply.json())["tokens"] == standin.token_ids("abcd")
        async with http.get("/standin/stats") as reply:
            stats = await reply.json()
    assert stats["POST /v1/chat/completions"] == 2
    assert stats["POST /tokenize"] == 1


async def test_the_python_load_generator_counts_requests_and_statuses(standin_url: str) -> None:
    result = await loadgen.run_python(standin_url, RequestShape(stream=True), 4, 0.3)
    assert result.requests > 10 and result.errors == 0
    assert 0 < result.p50_s <= result.p99_s


async def test_error_statuses_are_counted_apart() -> None:
    async def unavailable(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": "busy"}, status=503)

    app = web.Application()
    app.router.add_post(loadgen.PATH, unavailable)
    async with serve_on_loopback(app) as url:
        result = await loadgen.run_python(url, RequestShape(stream=False), 2, 0.2)
    assert result.bad_status == result.requests > 0 and result.socket_errors == 0


def test_the_wrk_script_splices_a_valid_body() -> None:
    shape = RequestShape(stream=True)
    head, tail = shape.halves()
    assert orjson.loads(head + b"0-17" + tail)["stream"] is True
    script = loadgen.wrk_script(shape)
    assert head.decode() in script and tail.decode() in script
    line = (
        'WRK_RESULT {"requests":100,"duration_us":2000000,"connect":0,"read":1,"write":0,'
        '"status":3,"timeout":0,"p50_us":900,"p99_us":2100}'
    )
    result = loadgen.parse_wrk_output(f"Running 2s test\n{line}\n")
    assert (result.rate, result.p50_s, result.errors) == (50.0, 0.0009, 4)


def test_cpu_is_read_for_a_process_and_its_children() -> None:
    before = proc_cpu.sample([os.getpid()])
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    used = proc_cpu.sample([os.getpid()]).since(before)
    assert 0.15 < used < 1.0
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert child.pid in proc_cpu.descendants(os.getpid())
        assert child.pid in proc_cpu.sample([os.getpid()]).processes
    finally:
        child.kill()
        child.wait()


def test_an_exited_thread_is_counted_from_stat() -> None:
    earlier = proc_cpu.ProcessCpu(schedstat_ns=5_000_000_000, stat_ticks=500)
    # A busy thread exited: live threads' schedstat fell, the group's stat did not.
    later = proc_cpu.ProcessCpu(schedstat_ns=4_000_000_000, stat_ticks=800)
    assert later.seconds_since(earlier) == pytest.approx(300 / proc_cpu.CLOCK_TICKS)
    exact = proc_cpu.ProcessCpu(schedstat_ns=6_234_000_000, stat_ticks=623)
    assert exact.seconds_since(earlier) == pytest.approx(1.234)
    before = proc_cpu.CpuSample({1: proc_cpu.ProcessCpu(0, 500, 100)})
    after = proc_cpu.CpuSample({1: proc_cpu.ProcessCpu(0, 600, 130)})
    assert after.system_share_since(before) == pytest.approx(0.3)


def test_the_namespace_check_refuses_a_way_out() -> None:
    lo, eth = netns.IFF_UP | netns.IFF_LOOPBACK, netns.IFF_UP
    netns.check_loopback_only({"lo": lo, "ifb0": 0})
    with pytest.raises(netns.NotIsolated, match="eth0"):
        netns.check_loopback_only({"lo": lo, "eth0": eth})
    with pytest.raises(netns.NotIsolated, match="loopback is down"):
        netns.check_loopback_only({"lo": netns.IFF_LOOPBACK})
    # The real reading: this namespace has loopback, whatever else it has.
    assert "lo" in netns.interface_flags()


def test_peers_are_not_started_outside_an_isolated_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.throughput.run import run_benchmark

    # Wherever the suite runs: the namespace reads as having a way out.
    lo, eth = netns.IFF_UP | netns.IFF_LOOPBACK, netns.IFF_UP
    monkeypatch.setattr(netns, "interface_flags", lambda: {"lo": lo, "eth0": eth})

    config = ThroughputConfig(peer_bin=tmp_path, out=tmp_path)
    with pytest.raises(netns.NotIsolated):
        asyncio.run(run_benchmark(config, Console(file=io.StringIO())))
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_peer_targets_take_both_policies(tmp_path: Path) -> None:
    (tmp_path / "smg").touch(mode=0o755)
    (tmp_path / "vllm-router").touch(mode=0o755)
    found = targets(ThroughputConfig(peer_bin=tmp_path))
    assert [t.label for t in found] == [
        "direct", "kvrouter round_robin", "kvrouter cache_aware",
        "smg round_robin", "vllm-router round_robin", "smg cache_aware",
        "vllm-router cache_aware",
    ]  # fmt: skip
    smg = next(t for t in found if t.label == "smg round_robin")
    assert smg.command is not None and "--disable-tokenizer-autoload" in smg.command
    assert with_policy(("x", "--policy", "cache_aware", "-v"), "round_robin") == (
        "x", "--policy", "round_robin", "-v",
    )  # fmt: skip


def test_another_checkouts_kvrouter_runs_its_own_code(tmp_path: Path) -> None:
    checkout = tmp_path / "before"
    (checkout / "router").mkdir(parents=True)
    (checkout / "router" / "__init__.py").write_text("")
    found = targets(ThroughputConfig(checkout=checkout, policies=("round_robin",)))
    assert [t.label for t in found] == [
        "direct",
        "kvrouter round_robin",
        "kvrouter@before round_robin",
    ]
    ours, theirs = found[1], found[2]
    assert ours.command == theirs.command and not ours.env
    # The checkout's package is the one imported, not the installed (editable) one.
    probe = (sys.executable, "-c", "import router; print(router.__file__)")
    imported = subprocess.run(
        probe, env={**os.environ, **dict(theirs.env)}, capture_output=True, text=True, check=True
    )
    assert imported.stdout.strip() == str(checkout.resolve() / "router" / "__init__.py")


def test_the_table_shows_median_and_range() -> None:
    def run(rate: float, round_index: int) -> Run:
        load = LoadResult(int(rate * 2), 2.0, 0.010, 0.050)
        return Run("kvrouter cache_aware", "whole", round_index, load, rate * 2 * 300e-6, 0.0,
                   int(rate * 2))  # fmt: skip

    table = runs_table([run(1000, 0), run(1200, 1), run(900, 2)], "whole")
    console = Console(width=200, record=True)
    console.print(table)
    text = console.export_text()
    assert "1,000 (900-1,200)" in text and "300" in text and "1.00" in text


async def test_the_rounds_measure_kvrouter(tmp_path: Path) -> None:
    config = ThroughputConfig(
        connections=4, warmup_s=0.2, duration_s=0.6, rounds=1, engines=2,
        policies=("round_robin",), generator="python", direct=False,
        router_port=free_port_run(1), base_port=free_port_run(2), out=tmp_path,
    )  # fmt: skip
    assert [t.label for t in targets(config)] == ["kvrouter round_robin"]
    output = io.StringIO()
    runs = await asyncio.wait_for(run_rounds(config, Console(file=output)), 60)
    assert [(r.target, r.variant) for r in runs] == [
        ("kvrouter round_robin", "whole"), ("kvrouter round_robin", "stream"),
    ]  # fmt: skip
    for r in runs:
        assert r.load.requests > 20 and r.load.errors == 0
        assert 0 < r.router_us < 100_000 and r.standin_us > 0
        assert r.engine_calls == pytest.approx(1.0, abs=0.2)


def test_pyspy_raw_stacks_summarize_to_own_and_inclusive_time() -> None:
    raw = [
        "<module> (run.py:1);serve (aiohttp/web.py:10);_handle (router/edge/relay.py:150) 6",
        "<module> (run.py:1);serve (aiohttp/web.py:12);"
        "parse_request (router/apis/request.py:140) 3",
        "<module> (run.py:1);serve (aiohttp/web.py:10) 1",
    ]
    profile = summarize(raw)
    assert profile.samples == 10
    assert profile.own["_handle (router/edge/relay.py)"] == 6
    assert profile.inclusive["serve (aiohttp/web.py)"] == 10
    assert profile.own_by_file["router/apis/request.py"] == 3
    assert "60.0%" in format_profile(profile)
