"""``kvrouter top`` against a real router."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket

import aiohttp
import pytest
from rich.console import Console

from router.cli import main
from router.cli.top import Snapshot, quantile, register, render
from router.config import AdmissionConfig
from tests.conftest import EngineFactory, router_config, serve_router
from tests.router_client import (
    chat_body,
    conversation,
    engines,
    held_stream,
    metric,
    post,
    wait_for,
)


def test_quantiles_come_from_the_increase_between_reads() -> None:
    def snap(counts: dict[str, float]) -> Snapshot:
        lines = [f'h_bucket{{outcome="hit",le="{le}"}} {n}' for le, n in counts.items()]
        return Snapshot.parse("# TYPE h histogram\n" + "\n".join(lines) + "\n")

    before = snap({"0.1": 10, "1.0": 10, "+Inf": 10})
    now = snap({"0.1": 10, "1.0": 19, "+Inf": 20})  # 10 new: 9 under 1 s, 1 slower
    assert quantile(now, before, "h", "hit", 0.5) == 1.0
    assert quantile(now, before, "h", "hit", 0.99) == float("inf")
    assert quantile(now, None, "h", "hit", 0.5) == 0.1
    assert quantile(now, now, "h", "hit", 0.5) is None


async def test_top_once_shows_workers_and_hit_rates(
    engine_factory: EngineFactory,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet)) as router,
        aiohttp.ClientSession() as http,
    ):
        messages = conversation("top", 300, 50)
        first = await post(http, router.url, chat_body(messages, max_tokens=8, user="u"))
        messages += [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "more"},
        ]
        await post(http, router.url, chat_body(messages, max_tokens=8, user="u"))
        # main() runs its own event loop: give it a thread.
        code = await asyncio.to_thread(main, ["top", router.url, "--once"])
    out = capsys.readouterr().out
    assert code == 0
    assert "w0" in out and "w1" in out
    assert "turns: first_turn" in out and "turns: hit" in out
    assert "hit rate, engine-reported" in out
    # A command line tool's output, not a log line per HTTP request it made.
    assert not [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))]


def test_what_every_process_sees_of_a_worker_is_counted_once() -> None:
    # Found: with --processes 2, top summed each process's view of one worker: twice its
    # capacity, and "healthy" 2.
    text = "".join(
        f'kvrouter_worker_{name}{{worker="w0",process="{p}"}} {value}\n'
        for p, (healthy, outstanding) in enumerate(((1, 3), (0, 4)))
        for name, value in (
            ("healthy", healthy),
            ("capacity_tokens", 50000),
            ("resident_tokens", 1000),
            ("outstanding_requests", outstanding),
        )
    )
    snap = Snapshot.parse(text)
    assert snap.seen("kvrouter_worker_capacity_tokens", "worker") == {"w0": 50000}
    assert snap.seen("kvrouter_worker_healthy", "worker", worst=True) == {"w0": 0}
    assert snap.by("kvrouter_worker_outstanding_requests", "worker") == {"w0": 7}
    console = Console(width=200, record=True)
    console.print(render(snap, None))
    row = next(line for line in console.export_text().splitlines() if "w0" in line)
    assert "NO" in row and "7" in row and "1,000 / 50,000" in row, row


def test_an_unreachable_router_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["top", f"http://127.0.0.1:{port}", "--once"])
    assert args.func(args) == 1
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"error: cannot read http://127.0.0.1:{port}/metrics") and "\n" not in out


def test_whole_worker_names_in_an_80_column_terminal() -> None:
    name = "vllm-decode-0.vllm-headless.inference.svc"
    text = "".join(
        f'kvrouter_worker_{metric}{{worker="{name}"}} {value}\n'
        for metric, value in (("healthy", 1), ("capacity_tokens", 400000), ("resident_tokens", 1))
    )
    console = Console(width=80, record=True)
    console.print(render(Snapshot.parse(text), None))
    assert name in console.export_text()


def test_the_router_url_comes_from_kvrouter_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTER_URL", "http://router.example:9000")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    assert parser.parse_args(["top"]).url == "http://router.example:9000"
    assert parser.parse_args(["top", "http://other:1"]).url == "http://other:1"


async def test_top_shows_the_queue_what_it_holds_and_sheds(
    engine_factory: EngineFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    limits = AdmissionConfig(enabled=True, max_outstanding_per_worker=1, queue_size=1)
    long = chat_body([{"role": "user", "content": "long"}], max_tokens=20_000)
    short = chat_body([{"role": "user", "content": "short"}], max_tokens=2)
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, admission=limits)) as router,
        aiohttp.ClientSession() as http,
        held_stream(http, router.url, long),
    ):
        held = asyncio.create_task(post(http, router.url, short))

        async def holding() -> bool:
            return await metric(http, router, "kvrouter_queue_depth") == 1

        await wait_for(holding)
        assert (await post(http, router.url, short)).status == 429
        code = await asyncio.to_thread(main, ["top", router.url, "--once"])
        held.cancel()
    out = capsys.readouterr().out
    assert code == 0
    assert "the router's queue" in out
    queue_rows = [line for line in out.splitlines() if "interactive" in line]
    assert queue_rows and "queue_full 1" in queue_rows[0] and " 1 " in queue_rows[0]
