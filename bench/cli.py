"""``kvrouter bench``: generate traces, replay them, compare results."""

from __future__ import annotations

import argparse
from typing import Any


def register(commands: argparse._SubParsersAction[Any]) -> None:
    from bench import dashboards
    from bench.aiperf import run as aiperf_client
    from bench.compare import agreement, apis, matrix, peers, replicas, rescore, sweep, tiers
    from bench.cost import engine_cpu, perf, request_walk
    from bench.cost import tokenize as tokenize_cost
    from bench.failure import kill
    from bench.failure import run as failure
    from bench.fuzz import run as fuzz
    from bench.real import run as real
    from bench.replay import cli as replay_cli
    from bench.soak import run as soak
    from bench.throughput import cli as throughput
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
    tiers.register(sub)
    apis.register(sub)
    failure.register(sub)
    real.register(sub)
    request_walk.register(sub)
    aiperf_client.register(sub)
