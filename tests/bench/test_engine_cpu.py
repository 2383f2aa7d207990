"""``kvrouter bench engine-cpu``: the engine of another checkout, measured beside this one."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import pytest

from bench.cost import engine_cpu
from bench.ports import free_port_run
from bench.sim.fleet import start_engine, stop, wait_healthy

REPO = Path(__file__).resolve().parents[2]


def _checkout_copy(tmp_path: Path) -> Path:
    """The packages an engine needs, copied as another checkout would hold them."""
    copy = tmp_path / "older"
    for package in ("router", "policies", "bench"):
        shutil.copytree(
            REPO / package, copy / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    return copy


def _cwd_and_environ(pid: int) -> tuple[Path, list[bytes]]:
    proc = Path(f"/proc/{pid}")
    return (proc / "cwd").readlink(), (proc / "environ").read_bytes().split(b"\0")


async def test_an_engine_source_runs_that_checkouts_engine(tmp_path: Path) -> None:
    source = _checkout_copy(tmp_path)
    port = free_port_run(1)
    engine = await start_engine("0", "127.0.0.1", port, ["--kv-tokens", "20000"], source)
    try:
        await wait_healthy([engine.url])
        cwd, environ = _cwd_and_environ(engine.process.pid)
        assert cwd == source
        assert f"PYTHONPATH={source}".encode() in environ
    finally:
        await stop([engine])


async def test_both_engines_are_sent_the_same_work(tmp_path: Path) -> None:
    source = _checkout_copy(tmp_path)
    port = free_port_run(1)
    here = await engine_cpu.measure(2, 2, 600, 20, 20.0, port, 50_000)
    there = await engine_cpu.measure(2, 2, 600, 20, 20.0, port, 50_000, source)
    assert here.generated_tokens == there.generated_tokens == 2 * 2 * 20
    assert here.prompt_tokens == there.prompt_tokens > 2 * 2 * 600


def test_a_source_without_an_engine_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    engine_cpu.register(parser.add_subparsers())
    args = parser.parse_args(["engine-cpu", "--engine-source", str(tmp_path)])
    assert args.func(args) == 2
    assert f"--engine-source {tmp_path}: no router package there" in capsys.readouterr().err


def test_cpu_seconds_are_what_the_process_ran_finer_than_clock_ticks() -> None:
    before, kernel_before = engine_cpu.process_cpu_seconds(os.getpid()), time.process_time()
    total = sum(i * i for i in range(200_000))  # a few ms of CPU, under one tick of /stat
    ran = engine_cpu.process_cpu_seconds(os.getpid()) - before
    assert total > 0 and ran > 0
    assert ran == pytest.approx(time.process_time() - kernel_before, abs=0.02)
