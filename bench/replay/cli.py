"""``kvrouter bench replay`` and ``kvrouter bench compare``."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.replay.client import DEFAULT_REQUEST_TIMEOUT_S, ModelDiscoveryError
from bench.replay.compare import compare, run_labels
from bench.replay.progress import ProgressDisplay
from bench.replay.report import print_run_report
from bench.replay.result import RunResult, load_result, save_result
from bench.replay.runner import (
    DEFAULT_CONCURRENCY,
    DEFAULT_TIME_SCALE,
    ReplayConfig,
    replay,
    select_sessions,
)
from bench.workloads.api_bodies import APIS, DEFAULT_API
from bench.workloads.trace import Session, read_trace

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction[Any]) -> None:
    rp = sub.add_parser(
        "replay",
        help="replay a trace against an OpenAI- or Anthropic-compatible endpoint",
        description="Replay a trace: sessions arrive open-loop at their first turn's "
        "arrival, turns within a session are closed-loop. Times in the result are "
        "simulated seconds (wall-clock x --time-scale).",
    )
    rp.add_argument(
        "--trace", type=Path, required=True, metavar="T", help="trace file (JSON lines)"
    )
    rp.add_argument(
        "--target",
        required=True,
        metavar="URL",
        action="append",
        help="base URL, e.g. http://127.0.0.1:8000; repeat for router replicas "
        "(each request goes to one at random)",
    )
    rp.add_argument(
        "--model", metavar="NAME", help="model name (default: the first listed by /v1/models)"
    )
    rp.add_argument(
        "--api",
        choices=APIS,
        default=DEFAULT_API,
        help="the API of sessions whose trace names none (a trace's per-session api "
        "wins): OpenAI chat completions, OpenAI responses (/v1/responses) or "
        "Anthropic messages (/v1/messages); default %(default)s",
    )
    rp.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        metavar="N",
        help="most requests in flight (default %(default)s)",
    )
    rp.add_argument(
        "--time-scale",
        type=float,
        default=DEFAULT_TIME_SCALE,
        metavar="S",
        help="the engine runs this many times faster than real time; waits "
        "are divided by it, measured times multiplied (default %(default)s)",
    )
    rp.add_argument(
        "--max-sessions", type=int, metavar="K", help="replay only the first K sessions"
    )
    rp.add_argument(
        "--duration",
        type=float,
        dest="duration_s",
        metavar="SECS",
        help="stop starting turns this many simulated seconds after the first arrival",
    )
    rp.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        metavar="SECS",
        help="wall seconds before a request is abandoned (default %(default)s)",
    )
    rp.add_argument(
        "--retries",
        type=int,
        default=0,
        metavar="N",
        help="send a refused turn (408, 409, 429, 5xx, no answer) again up to N times, "
        "as the OpenAI and Anthropic SDKs do (they default to 2); a session refused "
        "after them gives up (default %(default)s: every failure is recorded and the "
        "session goes on)",
    )
    rp.add_argument(
        "--slo-ttft",
        type=float,
        dest="slo_ttft_s",
        metavar="SECS",
        help="a time-to-first-token objective in simulated seconds: the result counts "
        "the turns within it (goodput: such turns a second) and each session's share",
    )
    rp.add_argument(
        "-o", "--output", type=Path, required=True, metavar="FILE", help="result JSON file"
    )
    rp.set_defaults(func=_replay_command)

    cp = sub.add_parser("compare", help="compare replay results side by side, with plots")
    cp.add_argument("results", type=Path, nargs="+", help="result JSON files")
    cp.add_argument(
        "--label",
        action="append",
        dest="labels",
        metavar="LABEL",
        help="a run's label, once per result in order (default: file stem)",
    )
    cp.add_argument("-o", "--plots-dir", type=Path, metavar="DIR", help="write PNG plots here")
    cp.set_defaults(func=_compare_command)


async def _replay_with_progress(config: ReplayConfig, sessions: list[Session]) -> RunResult:
    total = sum(len(s.turns) for s in sessions)
    async with ProgressDisplay(total) as display:
        return await replay(config, sessions, display.add)


def _replay_command(args: argparse.Namespace) -> int:
    try:
        config = ReplayConfig(
            target=args.target[0],
            more_targets=tuple(args.target[1:]),
            trace=args.trace,
            model=args.model,
            concurrency=args.concurrency,
            time_scale=args.time_scale,
            max_sessions=args.max_sessions,
            duration_s=args.duration_s,
            request_timeout_s=args.request_timeout,
            api=args.api,
            slo_ttft_s=args.slo_ttft_s,
            retries=args.retries,
        )
        turns = read_trace(args.trace)
    except (ValueError, OSError) as exc:  # TraceFormatError is a ValueError
        log.error("%s", exc)
        return 2
    sessions = select_sessions(turns, config.max_sessions, config.duration_s)
    log.info(
        "replaying %d sessions (%d requests) from %s",
        len(sessions),
        sum(len(s.turns) for s in sessions),
        args.trace,
    )
    try:
        result = asyncio.run(_replay_with_progress(config, sessions))
    except ModelDiscoveryError as exc:
        log.error("%s; pass --model", exc)
        return 1
    save_result(result, args.output)
    summary = print_run_report(result, Console())
    log.info("wrote %s", args.output)
    return 1 if summary.requests and summary.errors == summary.requests else 0


def _compare_command(args: argparse.Namespace) -> int:
    try:
        labels = run_labels(args.results, args.labels)
        runs = [load_result(path) for path in args.results]
    except (ValueError, OSError) as exc:  # ResultFormatError is a ValueError
        log.error("%s", exc)
        return 2
    compare(runs, labels, Console(), args.plots_dir)
    return 0
