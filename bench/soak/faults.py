"""The soak benchmark's faults, one disturbance at a time, and their timeline.

Kinds (``FAULT_KINDS``), each applied to one worker for ``FaultPlan.duration_s``:

* ``restart``: SIGKILL, then the engine started again on the same port (empty cache);
* ``hang``: SIGSTOP, then SIGCONT (the kernel still accepts connections: nothing answers);
* ``fail``: the engine answers every completion 500 (``bench/sim/faults.py``), /health 200;
* ``stall``: the engine stops making progress, /health included (``bench/sim/faults.py``);
* ``drain``: ``POST /admin/workers/{name}/drain``, then ``DELETE`` it;
* ``remove``: ``DELETE /admin/workers/{name}``, then ``POST /admin/workers`` again.

Every ``FaultPlan.outage_every_s`` the fault is instead an *outage*: every engine killed at
once, all started again after ``outage_s``. One disturbance at a time, so with two or more
workers another one can always serve (the router retries on ``max_attempts`` = 2 workers);
only during an outage can none.

Each fault is a ``FaultEvent`` with when it started, when it was lifted, and when the router
routed to the worker again (healthy, not draining, circuit closed). The window from an
outage's start until the router answers ``/ready`` again is when no worker could serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import aiohttp

from bench.sim.fleet import EngineProcess, start_engine, stop, wait_healthy

FAULT_KINDS = ("restart", "hang", "fail", "stall", "drain", "remove")
OUTAGE = "outage"
# How long the router may take to route to a worker again once its fault is lifted.
RECOVERY_TIMEOUT_S = 60.0
POLL_S = 0.1
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class FaultPlan:
    kinds: tuple[str, ...] = FAULT_KINDS
    every_s: float = 20.0  # quiet time after one fault's recovery before the next
    duration_s: float = 10.0  # how long each fault lasts
    outage_every_s: float = 600.0  # 0: no outage
    outage_s: float = 5.0
    first_at_s: float = 10.0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.kinds) - set(FAULT_KINDS))
        if unknown:
            raise ValueError(f"unknown fault {unknown[0]!r}; known: {', '.join(FAULT_KINDS)}")
        if min(self.every_s, self.duration_s, self.outage_s) <= 0 or self.outage_every_s < 0:
            raise ValueError("fault intervals and durations must be > 0 (outage_every_s >= 0)")


@dataclass(slots=True)
class FaultEvent:
    kind: str
    workers: tuple[str, ...]
    started: float
    lifted: float | None = None
    serving: float | None = None  # the router could route to one of ``workers`` again
    recovered: float | None = None  # ... to every one of them
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        def at(value: float | None) -> float | None:
            return None if value is None else round(value, 3)

        return {
            "kind": self.kind,
            "workers": list(self.workers),
            "started": at(self.started),
            "lifted": at(self.lifted),
            "serving": at(self.serving),
            "recovered": at(self.recovered),
            "note": self.note,
        }


class SoakFleet:
    """The engine processes, one slot per worker (a restart replaces its slot's process),
    and the router's admin API, through which the report's ground truth is also read."""

    def __init__(
        self,
        host: str,
        base_port: int,
        count: int,
        flags: Sequence[str],
        http: aiohttp.ClientSession,
        log: IO[bytes] | None = None,
    ) -> None:
        self._host, self._base_port, self._flags = host, base_port, list(flags)
        self.control = http  # the benchmark's own requests: faults, admin, samples
        self._log = log  # every engine's stderr
        self.engines: list[EngineProcess | None] = [None] * count
        self.paused: set[int] = set()
        self.router_url = ""
        self.admin_token = ""

    def __len__(self) -> int:
        return len(self.engines)

    def url(self, i: int) -> str:
        return f"http://{self._host}:{self._base_port + i}"

    def name(self, i: int) -> str:
        """The router's name for the worker (from ``--worker URL``: host:port)."""
        return f"{self._host}:{self._base_port + i}"

    async def start(self, i: int) -> None:
        self.engines[i] = await start_engine(
            str(i), self._host, self._base_port + i, self._flags, log=self._log
        )
        await wait_healthy([self.url(i)])

    async def start_all(self) -> None:
        await asyncio.gather(*(self.start(i) for i in range(len(self))))

    async def kill(self, i: int) -> None:
        engine = self.engines[i]
        if engine is not None:
            engine.kill()
            await engine.process.wait()
            self.engines[i] = None

    def pause(self, i: int) -> None:
        self._signal(i, signal.SIGSTOP)
        self.paused.add(i)

    def resume(self, i: int) -> None:
        self._signal(i, signal.SIGCONT)
        self.paused.discard(i)

    def _signal(self, i: int, sig: signal.Signals) -> None:
        engine = self.engines[i]
        if engine is not None:
            with contextlib.suppress(ProcessLookupError):
                engine.process.send_signal(sig)

    async def stop_all(self) -> None:
        for i in list(self.paused):
            self.resume(i)
        await stop([e for e in self.engines if e is not None])

    async def engine_faults(self, i: int, **faults: bool) -> None:
        async with self.control.post(self.url(i) + "/sim/faults", json=faults) as response:
            response.raise_for_status()

    async def admin(self, method: str, path: str, body: Any = None) -> Any:
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        async with self.control.request(
            method, self.router_url + path, json=body, headers=headers
        ) as response:
            response.raise_for_status()
            return await response.json()

    async def circuits(self) -> dict[str, str]:
        """The circuit of each worker the router would route to, given a request: healthy,
        not draining, its circuit closed or half-open (waiting for a request to try)."""
        listed = await self.admin("GET", "/admin/workers")
        return {
            w["name"]: w["circuit"]
            for w in listed["workers"]
            if w["healthy"] and not w["draining"] and w["circuit"] != "open"
        }

    async def ready(self) -> bool:
        async with self.control.get(self.router_url + "/ready") as response:
            return response.status == 200


Action = Callable[[SoakFleet, int], Awaitable[None]]


async def _restart_down(fleet: SoakFleet, i: int) -> None:
    await fleet.kill(i)


async def _restart_up(fleet: SoakFleet, i: int) -> None:
    await fleet.start(i)


async def _hang(fleet: SoakFleet, i: int) -> None:
    fleet.pause(i)


async def _unhang(fleet: SoakFleet, i: int) -> None:
    fleet.resume(i)


def _engine_fault(name: str, on: bool) -> Action:
    async def apply(fleet: SoakFleet, i: int) -> None:
        await fleet.engine_faults(i, **{name: on})

    return apply


async def _drain(fleet: SoakFleet, i: int) -> None:
    await fleet.admin("POST", f"/admin/workers/{fleet.name(i)}/drain")


async def _undrain(fleet: SoakFleet, i: int) -> None:
    await fleet.admin("DELETE", f"/admin/workers/{fleet.name(i)}/drain")


async def _remove(fleet: SoakFleet, i: int) -> None:
    await fleet.admin("DELETE", f"/admin/workers/{fleet.name(i)}")


async def _readd(fleet: SoakFleet, i: int) -> None:
    await fleet.admin("POST", "/admin/workers", {"url": fleet.url(i), "name": fleet.name(i)})


# Each kind: how it starts and how it is lifted.
FAULTS: dict[str, tuple[Action, Action]] = {
    "restart": (_restart_down, _restart_up),
    "hang": (_hang, _unhang),
    "fail": (_engine_fault("fail_requests", True), _engine_fault("fail_requests", False)),
    "stall": (_engine_fault("stall", True), _engine_fault("stall", False)),
    "drain": (_drain, _undrain),
    "remove": (_remove, _readd),
}


async def _wait_back(
    fleet: SoakFleet, event: FaultEvent, clock: Clock, traffic_done: asyncio.Event
) -> None:
    """Sets ``serving`` and ``recovered`` as the router takes the workers back (their
    circuits closed). Once the traffic is done, a half-open circuit stays so (no request
    comes to try it): that ends the wait, with a note."""
    deadline = clock() + RECOVERY_TIMEOUT_S
    workers = set(event.workers)
    while clock() < deadline:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            circuits = await fleet.circuits()
            back = {w for w in workers if circuits.get(w) == "closed"}
            if back and event.serving is None:
                event.serving = clock()
            if back == workers:
                event.recovered = clock()
                return
            if traffic_done.is_set() and workers <= circuits.keys():
                event.note = "half-open after the traffic ended: no request came to try it"
                return
        await asyncio.sleep(POLL_S)
    event.note = f"not all back in rotation {RECOVERY_TIMEOUT_S:g} s after the fault was lifted"


async def disturb(
    fleet: SoakFleet,
    kind: str,
    i: int,
    duration_s: float,
    event: FaultEvent,
    clock: Clock,
    traffic_done: asyncio.Event,
) -> None:
    begin, lift = FAULTS[kind]
    try:
        await begin(fleet, i)
        await asyncio.sleep(duration_s)
    finally:
        await lift(fleet, i)
        event.lifted = clock()
    await _wait_back(fleet, event, clock, traffic_done)


async def outage(
    fleet: SoakFleet,
    duration_s: float,
    event: FaultEvent,
    clock: Clock,
    traffic_done: asyncio.Event,
) -> None:
    """Every engine killed at once, all started again after ``duration_s``; ``serving``
    is when the router answers /ready again."""
    try:
        await asyncio.gather(*(fleet.kill(i) for i in range(len(fleet))))
        await asyncio.sleep(duration_s)
    finally:
        await fleet.start_all()
        event.lifted = clock()
    deadline = clock() + RECOVERY_TIMEOUT_S
    while clock() < deadline and event.serving is None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            if await fleet.ready():
                event.serving = clock()
                break
        await asyncio.sleep(POLL_S / 2)
    await _wait_back(fleet, event, clock, traffic_done)


async def run_faults(
    plan: FaultPlan,
    fleet: SoakFleet,
    clock: Clock,
    stop_at: float,
    traffic_done: asyncio.Event,
    seed: int,
    events: list[FaultEvent],
) -> None:
    """Faults one after another until ``stop_at`` (none starts that could not be lifted
    and recovered from before it); each is appended to ``events`` when it starts.
    ``traffic_done``: the clients have stopped and their last requests ended."""
    rng = random.Random(f"{seed}-faults")
    await asyncio.sleep(plan.first_at_s)
    next_outage = (
        clock() - plan.first_at_s + plan.outage_every_s if plan.outage_every_s else math.inf
    )
    rotation: list[str] = []
    names = tuple(fleet.name(i) for i in range(len(fleet)))
    while True:
        is_outage = clock() >= next_outage
        duration = plan.outage_s if is_outage else plan.duration_s
        if not plan.kinds and not is_outage:
            return
        if clock() + duration + plan.every_s > stop_at:
            return
        if is_outage:
            next_outage += plan.outage_every_s
            event = FaultEvent(OUTAGE, names, clock())
            action = outage(fleet, duration, event, clock, traffic_done)
        else:
            if not rotation:
                rotation = rng.sample(plan.kinds, len(plan.kinds))
            kind, i = rotation.pop(), rng.randrange(len(fleet))
            event = FaultEvent(kind, (names[i],), clock())
            action = disturb(fleet, kind, i, duration, event, clock, traffic_done)
        events.append(event)
        try:
            await action
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            # The fault could not be applied or lifted (an admin call refused, an engine
            # that did not start): a finding of its own, and the run goes on.
            event.note = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(plan.every_s)


def no_worker_windows(
    events: Sequence[FaultEvent], workers: int, end: float
) -> list[tuple[float, float]]:
    """When no worker could serve: from the start of each fault that took every worker
    out until the router could route to one again (``end`` if it never could)."""
    return [
        (e.started, e.serving if e.serving is not None else end)
        for e in events
        if len(e.workers) >= workers
    ]
