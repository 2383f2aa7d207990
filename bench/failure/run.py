"""``kvrouter bench failure``: what losing a worker costs, and what a checkpoint saves.

A fleet of simulated engines (processes, real clock sped up by ``--time-scale``) serves
the demo's agent workload through ``kvrouter serve``. In each round the same trace is
replayed once per scenario, in an order rotated from round to round, each time through
a fresh router in front of engines whose caches were emptied; a task beside the replay
injects the scenario's failure of worker ``w0`` (the first engine):

- ``none``: no failure; the baseline.
- ``cold``: SIGKILL at ``--kill-at``; ``--restart-after`` later a fresh engine starts on
  the same port (the router sees a new process and purges what it knew of it).
- ``restore``: ``--checkpoint-before`` seconds before the kill the engine writes a
  checkpoint (``POST /sim/checkpoint``); SIGKILL at ``--kill-at``; ``--restart-after``
  later an engine restored from the checkpoint starts on a new port, and the admin API
  adds it as ``w0r``, migrates ``w0`` onto it and removes ``w0``.
- ``gone``: SIGKILL at ``--kill-at``, no replacement.

Figures per scenario (``bench.failure.figures`` defines them): the sessions affected
(their last request before the kill went to ``w0``), the tokens they re-prefilled after
the kill beyond the run without a failure, the TTFT p50/p99 of their next three turns,
the fleet's hit rate over the minute after the kill, requests failed; median (min-max)
over ``--repeat`` rounds. Writes every run, ``failure.json`` and the plots of the last
round (``bench.failure.plots``) to ``--out``. Times are simulated seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console

from bench.compare.demo import (
    DEFAULT_KV_TOKENS,
    DEFAULT_RATE,
    DEFAULT_SESSIONS,
    DEFAULT_TIME_SCALE,
    REQUEST_TIMEOUT_S,
    DemoConfig,
    RouterSpec,
    Workload,
    demo_workload,
    empty_caches,
    engine_flags,
    kvrouter_command,
    running_router,
)
from bench.failure.report import Events, Round, RunFigures, figures_of, print_table, save_report
from bench.replay.client import discover_model
from bench.replay.progress import ProgressDisplay
from bench.replay.result import RunResult, save_result
from bench.replay.rounds import rotated
from bench.replay.runner import ReplayConfig, replay, select_sessions
from bench.sim.fleet import EngineProcess, fleet, start_engine, stop, wait_healthy
from bench.workloads.trace import Turn, write_trace
from router.clock import monotonic
from router.config import DEFAULT_POLICY, HealthConfig

log = logging.getLogger(__name__)

SCENARIOS = ("none", "cold", "restore", "gone")
DEFAULT_ENGINES = 4
# Simulated seconds. At 250 s nine of the demo's sixteen sessions are running, spread
# over the four workers; the run goes on for ~300 s after it.
DEFAULT_KILL_AT = 250.0
DEFAULT_CHECKPOINT_BEFORE = 30.0
DEFAULT_OUT = Path("results/failure")
DEFAULT_BASE_PORT = 8170
DEFAULT_ROUTER_PORT = 8070
RESTORED_NAME = "w0r"


@dataclass(frozen=True, slots=True)
class FailureConfig:
    demo: DemoConfig = field(default_factory=lambda: DemoConfig(clock="real"))
    kill_at: float = DEFAULT_KILL_AT  # simulated seconds into the replay
    checkpoint_before: float = DEFAULT_CHECKPOINT_BEFORE
    # Kill to launching the replacement; None: one health-probe interval, after which
    # the router has seen the worker go (the engine's own start comes on top).
    restart_after: float | None = None
    scenarios: tuple[str, ...] = SCENARIOS
    policy: str = DEFAULT_POLICY

    def __post_init__(self) -> None:
        if self.demo.virtual:
            raise ValueError("the failure bench runs on the real clock (processes)")
        unknown = set(self.scenarios) - set(SCENARIOS)
        if unknown:
            raise ValueError(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
        if self.kill_at <= 0 or self.checkpoint_before < 0 or self.restart_delay < 0:
            raise ValueError("kill_at must be > 0; checkpoint_before, restart_after >= 0")
        if self.checkpoint_before >= self.kill_at:
            raise ValueError("the checkpoint must come after the replay starts")

    @property
    def restart_delay(self) -> float:
        if self.restart_after is not None:
            return self.restart_after
        return HealthConfig().interval_s * self.demo.time_scale

    @property
    def restore_port(self) -> int:
        return self.demo.base_port + self.demo.engines


class Injection:
    """The failure of one scenario, injected beside its replay: owns the replacement
    engines it starts until ``close``."""

    def __init__(
        self,
        config: FailureConfig,
        engines: list[EngineProcess],
        router: str,
        admin_token: str,
        checkpoint: Path,
    ) -> None:
        self._config = config
        self._engines = engines
        self._router = router
        self._headers = {"Authorization": f"Bearer {admin_token}"}
        self._checkpoint = checkpoint
        self._extra: list[EngineProcess] = []
        self._taken_at: float | None = None  # the checkpoint's wall-clock time
        self.events = Events()
        self._t0 = monotonic()

    def _now(self) -> float:
        return (monotonic() - self._t0) * self._config.demo.time_scale

    async def _until(self, simulated: float) -> None:
        await asyncio.sleep(max(0.0, simulated - self._now()) / self._config.demo.time_scale)

    async def run(self, scenario: str) -> None:
        if scenario == "none":
            return
        cfg = self._config
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            if scenario == "restore":
                await self._until(cfg.kill_at - cfg.checkpoint_before)
                taken = await self._post(
                    http, f"{self._engines[0].url}/sim/checkpoint", path=self._path
                )
                self.events.checkpoint = self._now()
                self.events.checkpoint_blocks = int(taken["cached_blocks"])
                self._taken_at = float(taken["taken_at"])
            await self._until(cfg.kill_at)
            self._engines[0].kill()
            self.events.kill = self._now()
            await self._engines[0].process.wait()
            if scenario == "gone":
                return
            await self._until(cfg.kill_at + cfg.restart_delay)
            if scenario == "cold":
                await self._restart_cold()
            else:
                await self._restore(http)

    @property
    def _path(self) -> str:
        return str(self._checkpoint.resolve())

    async def _restart_cold(self) -> None:
        self.events.replacement_started = self._now()
        old = self._engines[0]
        self._engines[0] = await start_engine(
            old.engine_id, self._config.demo.host, old.port, engine_flags(self._config.demo)
        )
        await wait_healthy([self._engines[0].url])
        self.events.replacement_healthy = self._now()

    async def _restore(self, http: aiohttp.ClientSession) -> None:
        demo = self._config.demo
        self.events.replacement_started = self._now()
        restored = await start_engine(
            f"{self._engines[0].engine_id}r",
            demo.host,
            self._config.restore_port,
            [*engine_flags(demo), "--restore", self._path],
        )
        self._extra.append(restored)
        await wait_healthy([restored.url])
        self.events.replacement_healthy = self._now()
        admin = f"{self._router}/admin/workers"
        source = worker_name(self._engines[0])
        await self._post(http, admin, url=restored.url, name=RESTORED_NAME)
        moved = await self._post(
            http,
            f"{admin}/{source}/migrate",
            to=RESTORED_NAME,
            checkpoint_taken_at=self._taken_at,
        )
        self.events.migrated = self._now()
        self.events.moved_tokens = int(moved["moved_tokens"])
        async with http.delete(f"{admin}/{source}", headers=self._headers) as response:
            await _raise_for_status(response)
        self.events.removed = self._now()

    async def _post(
        self, http: aiohttp.ClientSession, endpoint: str, **body: str | float | None
    ) -> dict[str, Any]:
        async with http.post(endpoint, json=body, headers=self._headers) as response:
            await _raise_for_status(response)
            answer: dict[str, Any] = await response.json()
            return answer

    async def close(self) -> None:
        await stop(self._extra)


async def _raise_for_status(response: aiohttp.ClientResponse) -> None:
    if response.status >= 400:
        text = await response.text()
        raise RuntimeError(f"{response.method} {response.url}: {response.status} {text[:300]}")


def worker_name(engine: EngineProcess) -> str:
    """The router's name for a worker given as ``--worker URL``: the URL's host:port."""
    return engine.url.split("://", 1)[1]


async def ensure_running(engines: list[EngineProcess], config: DemoConfig) -> None:
    """Every engine of the fleet up (a scenario before may have left ``w0`` dead)."""
    for i, engine in enumerate(engines):
        if engine.process.returncode is not None:
            engines[i] = await start_engine(
                engine.engine_id, config.host, engine.port, engine_flags(config)
            )
    await wait_healthy([e.url for e in engines])


@dataclass(frozen=True, slots=True)
class Scenario:
    """What one round replays: the trace, its sessions, where runs go."""

    turns: Sequence[Turn]
    trace: Path
    model: str
    round_index: int


async def run_scenario(
    config: FailureConfig,
    engines: list[EngineProcess],
    scenario: str,
    plan: Scenario,
) -> tuple[RunResult, Events]:
    demo = config.demo
    await ensure_running(engines, demo)
    await empty_caches(engines)
    token = secrets.token_hex(16)
    command = kvrouter_command(
        demo, config.policy, [e.url for e in engines], demo.router_port, "--admin-token", token
    )
    spec = RouterSpec(scenario, (command,), (demo.router_port,))
    checkpoint = demo.out / f"checkpoint.r{plan.round_index + 1}.json"
    sessions = select_sessions(plan.turns)
    async with running_router(spec, demo.host) as urls:
        replay_config = ReplayConfig(
            target=urls[0],
            trace=plan.trace,
            model=plan.model,
            time_scale=demo.time_scale,
            request_timeout_s=REQUEST_TIMEOUT_S,
            api=demo.api,
        )
        injection = Injection(config, engines, urls[0], token, checkpoint)
        inject = asyncio.create_task(injection.run(scenario))
        try:
            async with ProgressDisplay(sum(len(s.turns) for s in sessions)) as display:
                result = await replay(replay_config, sessions, display.add)
            if not inject.done():
                inject.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await inject
                if injection.events.kill is None:
                    raise RuntimeError(f"{scenario}: the replay ended before the kill")
                log.warning("%s: the replay ended before the replacement served", scenario)
            else:
                inject.result()  # the injection's error, if any
        finally:
            inject.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await inject
            await injection.close()
    return result, injection.events


async def run_failure(
    config: FailureConfig, console: Console, workload: Workload = demo_workload
) -> list[Round]:
    demo = config.demo
    demo.out.mkdir(parents=True, exist_ok=True)
    rounds: list[Round] = []
    async with fleet(demo.engines, demo.host, demo.base_port, engine_flags(demo)) as engines:
        console.print(
            f"fleet: {demo.engines} simulated engines, {demo.kv_tokens:,} KV tokens each, "
            f"real time, time scale {demo.time_scale:g}; kill w0 ({worker_name(engines[0])}) "
            f"at {config.kill_at:g} s, replacement {config.restart_delay:g} s later, "
            f"checkpoint {config.checkpoint_before:g} s before the kill"
        )
        async with aiohttp.ClientSession() as http:
            model = await discover_model(http, engines[0].url)
        turns = list(workload(demo))
        trace = demo.out / "trace.jsonl"
        write_trace(turns, trace)
        for round_index in range(demo.repeat):
            plan = Scenario(turns, trace, model, round_index)
            runs: dict[str, tuple[RunResult, Events]] = {}
            for scenario in rotated(config.scenarios, round_index):
                console.print(f"round {round_index + 1}/{demo.repeat}: {scenario}")
                runs[scenario] = await run_scenario(config, engines, scenario, plan)
                save_result(runs[scenario][0], demo.out / f"{scenario}.r{round_index + 1}.json")
            rounds.append(_score_round(config, engines[0], runs))
    print_table(console, rounds, config.scenarios)
    save_report(rounds, config, demo.out / "failure.json")
    from bench.failure.plots import write_failure_plots  # matplotlib: only when drawing

    for path in write_failure_plots(rounds[-1], worker_name(engines[0]), demo.out):
        console.print(f"wrote {path}")
    return rounds


def _score_round(
    config: FailureConfig, w0: EngineProcess, runs: dict[str, tuple[RunResult, Events]]
) -> Round:
    baseline = runs["none"][0].records if "none" in runs else None
    figures: dict[str, RunFigures] = {}
    for scenario in config.scenarios:  # in the configured order, not the round's
        result, events = runs[scenario]
        at = config.kill_at if events.kill is None else events.kill
        figures[scenario] = figures_of(result, events, worker_name(w0), at, baseline)
    return Round(figures, {s: runs[s][0] for s in config.scenarios})


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser(
        "failure",
        help="kill a worker mid-run: cold restart, restore from a checkpoint, or none",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--engines", type=int, default=DEFAULT_ENGINES)
    parser.add_argument("--sessions", type=int, default=DEFAULT_SESSIONS)
    parser.add_argument("--rate", type=float, default=DEFAULT_RATE, help="sessions/s (simulated)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--kv-tokens", type=int, default=DEFAULT_KV_TOKENS)
    parser.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE)
    parser.add_argument("--policy", default=DEFAULT_POLICY)
    parser.add_argument("--repeat", type=int, default=3, help="rounds; median (min-max)")
    parser.add_argument(
        "--kill-at", type=float, default=DEFAULT_KILL_AT, help="simulated seconds into the run"
    )
    parser.add_argument(
        "--checkpoint-before",
        type=float,
        default=DEFAULT_CHECKPOINT_BEFORE,
        help="simulated seconds before the kill the checkpoint is taken (restore)",
    )
    parser.add_argument(
        "--restart-after",
        type=float,
        default=None,
        help="simulated seconds from the kill to launching the replacement (default: one "
        "router health-probe interval; the engine's start comes on top)",
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="comma-separated, from " + ", ".join(SCENARIOS),
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT)
    parser.add_argument("--router-port", type=int, default=DEFAULT_ROUTER_PORT)
    parser.set_defaults(func=run)


def failure_config(args: argparse.Namespace) -> FailureConfig:
    demo = DemoConfig(
        engines=args.engines,
        sessions=args.sessions,
        rate=args.rate,
        seed=args.seed,
        kv_tokens=args.kv_tokens,
        time_scale=args.time_scale,
        out=args.out,
        base_port=args.base_port,
        router_port=args.router_port,
        repeat=args.repeat,
        clock="real",
    )
    return FailureConfig(
        demo=demo,
        kill_at=args.kill_at,
        checkpoint_before=args.checkpoint_before,
        restart_after=args.restart_after,
        scenarios=tuple(s for s in args.scenarios.split(",") if s),
        policy=args.policy,
    )


def run(args: argparse.Namespace) -> int:
    config = failure_config(args)
    asyncio.run(run_failure(config, Console()))
    return 0
