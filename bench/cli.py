"""``kvrouter bench``: generate traces, replay them, compare results."""

from __future__ import annotations

import argparse
from typing import Any


def register(commands: argparse._SubParsersAction[Any]) -> None:
    from bench import (
        agreement,
        apis_bench,
        dashboards,
        engine_cpu,
        failure,
        fuzz,
        kill,
        matrix,
        peers,
        perf,
        real,
        replicas,
        request_walk,
        rescore,
        soak,
        sweep,
        throughput,
        tokenize_cost,
    )
    from bench.replay import cli as replay_cli
    from bench.workloads import cli as workloads_cli

    bench = commands.add_parser("bench", help="workload traces, replay and comparison")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH_COMMAND")
    workloads_cli.register(sub)
    replay_cli.register(sub)
    perf.register(sub)
    engine_cpu.register(sub)
    peers.register(sub)
    replicas.register(sub)
    matrix.register(sub)
    rescore.register(sub)
    sweep.register(sub)
    kill.register(sub)
    throughput.register(sub)
    dashboards.register(sub)
    fuzz.register(sub)
    soak.register(sub)
    tokenize_cost.register(sub)
    agreement.register(sub)
    apis_bench.register(sub)
    failure.register(sub)
    real.register(sub)
    request_walk.register(sub)
