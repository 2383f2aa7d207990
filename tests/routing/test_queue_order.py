"""The queue's release rule on real workers, with the clock in the test's hands: who
goes first when room opens, how waiting ages a long prompt, fairness across client keys,
and a held request moving to a worker that has room."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest
from prometheus_client import CollectorRegistry

from router.config import AdmissionConfig
from router.errors import Shed
from router.fleet.workers import Fleet, Lease, Worker
from router.observability.queue_metrics import QueueMetrics
from router.routing import queue as queue_module
from router.routing.queue import RequestQueue

RATE = 10_000.0  # prefill tokens a second, every worker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Request:
    """A held request's side of the queue: where it would go; released, it takes a
    lease on its worker as a dispatch does."""

    def __init__(self, fleet: Fleet, name: str, would_go: str | None = None) -> None:
        self.fleet = fleet
        self.name = name
        self.would_go = would_go
        self.took: str | None = None
        self.lease: Lease | None = None
        self.asked = 0  # times the queue asked where it would go now

    def rechoose(self, held_prefill: Mapping[str, int]) -> str | None:
        self.asked += 1
        return self.would_go

    def take(self, worker: str) -> bool:
        self.took = worker
        self.lease = Lease(self.fleet.workers[worker], 100, 100)
        return True


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(queue_module, "monotonic", fake)
    return fake


def _fleet(*names: str) -> Fleet:
    fleet = Fleet()
    for name in names:
        fleet.add(Worker(name, f"http://{name}", capacity_tokens=100_000))
    return fleet


def _busy(worker: Worker) -> Lease:
    """The one request the worker takes (``max_outstanding_per_worker`` 1)."""
    return Lease(worker, 100, 0)


def _queue(fleet: Fleet, **limits: object) -> RequestQueue:
    settings: dict[str, object] = {"max_outstanding_per_worker": 1, **limits}
    config = AdmissionConfig(enabled=True, **settings)  # type: ignore[arg-type]
    return RequestQueue(config, fleet, lambda worker: RATE, QueueMetrics(CollectorRegistry()))


async def _hold(
    queue: RequestQueue,
    request: Request,
    target: str,
    prefill: int,
    tenant: str | None = None,
    priority: str = "interactive",
) -> asyncio.Task[None]:
    task = asyncio.create_task(
        queue.hold(request, target, priority, prefill, prefill, 100, tenant, request.name)
    )
    await asyncio.sleep(0)  # held now
    return task


def _first_turn(queue: RequestQueue, request: Request, target: str) -> asyncio.Task[None]:
    """A new session's first turn (500 tokens), held for ``target`` once the loop runs."""
    held = queue.hold(
        request, target, "interactive", 500, 500, 100, None, request.name, first_turn=True
    )
    return asyncio.create_task(held)


async def _room_on(queue: RequestQueue, lease: Lease) -> None:
    lease.release()
    queue.notify()
    await asyncio.sleep(0)  # the pump
    await asyncio.sleep(0)  # the released request's task


async def _released_order(
    queue: RequestQueue, busy: Lease, requests: list[Request], tasks: list[asyncio.Task[None]]
) -> list[str]:
    order: list[str] = []
    while len(order) < len(requests):
        await _room_on(queue, busy)
        taken = [r for r in requests if r.took is not None and r.name not in order]
        assert len(taken) == 1  # one request at a time fits
        order.append(taken[0].name)
        assert taken[0].lease is not None
        busy = taken[0].lease
    await asyncio.gather(*tasks)
    return order


async def test_the_least_prefill_goes_first(clock: Clock) -> None:
    fleet = _fleet("w0")
    busy = _busy(fleet.workers["w0"])
    queue = _queue(fleet)
    fresh, cached = Request(fleet, "fresh"), Request(fleet, "cached")
    tasks = [await _hold(queue, fresh, "w0", 40_000), await _hold(queue, cached, "w0", 500)]
    assert await _released_order(queue, busy, [fresh, cached], tasks) == ["cached", "fresh"]


async def test_waiting_ages_a_long_prompt_ahead_of_later_short_ones(clock: Clock) -> None:
    fleet = _fleet("w0")
    busy = _busy(fleet.workers["w0"])
    queue = _queue(fleet, queue_timeout_s=60.0)
    fresh, cached = Request(fleet, "fresh"), Request(fleet, "cached")
    first = await _hold(queue, fresh, "w0", 40_000)  # 4 s of prefill
    clock.now += 4.5  # waited longer than its prefill is longer
    tasks = [first, await _hold(queue, cached, "w0", 500)]
    assert await _released_order(queue, busy, [fresh, cached], tasks) == ["fresh", "cached"]


async def test_a_key_with_fewer_requests_in_flight_goes_first(clock: Clock) -> None:
    fleet = _fleet("w0")
    busy = _busy(fleet.workers["w0"])
    queue = _queue(fleet)
    queue.started("busy", "s-a")
    queue.started("busy", "s-b")
    loud, quiet = Request(fleet, "loud"), Request(fleet, "quiet")
    tasks = [
        await _hold(queue, loud, "w0", 500, tenant="busy"),
        await _hold(queue, quiet, "w0", 20_000, tenant="quiet"),
    ]
    assert await _released_order(queue, busy, [loud, quiet], tasks) == ["quiet", "loud"]


async def test_a_held_request_moves_to_a_worker_with_room_when_it_would_rather(
    clock: Clock,
) -> None:
    fleet = _fleet("w0", "w1")
    on_w0, on_w1 = (_busy(w) for w in fleet.all())
    queue = _queue(fleet)
    stays = Request(fleet, "stays", would_go="w0")
    moves = Request(fleet, "moves", would_go="w1")
    tasks = [await _hold(queue, stays, "w0", 500), await _hold(queue, moves, "w0", 500)]
    await _room_on(queue, on_w1)
    assert (stays.took, moves.took) == (None, "w1")
    assert queue.depth() == 1
    await _room_on(queue, on_w0)
    assert stays.took == "w0"
    await asyncio.gather(*tasks)


async def test_a_held_request_whose_worker_left_chooses_again(clock: Clock) -> None:
    fleet = _fleet("w0")
    _busy(fleet.workers["w0"])
    queue = _queue(fleet)
    orphan = Request(fleet, "orphan")
    task = await _hold(queue, orphan, "w0", 500)
    fleet.remove("w0")
    queue.notify()
    await asyncio.wait_for(task, 1)  # released without a worker: its lifecycle chooses
    assert orphan.took is None and queue.depth() == 0 and queue.held_prefill == {}


async def test_a_held_request_whose_worker_drains_chooses_again(clock: Clock) -> None:
    # Found in review: only health was looked at; a draining worker kept its queue.
    fleet = _fleet("w0")
    _busy(fleet.workers["w0"])
    queue = _queue(fleet)
    held = Request(fleet, "held")
    task = await _hold(queue, held, "w0", 500)
    fleet.workers["w0"].draining = True
    queue.notify()
    await asyncio.wait_for(task, 1)
    assert held.took is None and queue.depth() == 0


async def test_batch_requests_are_displaced_only_when_that_makes_room(clock: Clock) -> None:
    # Found in review: an interactive request too large for the queue shed every held
    # batch request and then was refused itself.
    fleet = _fleet("w0")
    _busy(fleet.workers["w0"])
    queue = _queue(fleet, queue_bytes=1000)
    batch = [Request(fleet, f"b{i}") for i in range(3)]
    tasks = [await _hold(queue, r, "w0", 500, priority="batch") for r in batch]
    too_big = asyncio.create_task(
        queue.hold(Request(fleet, "big"), "w0", "interactive", 500, 500, 5000, None, "big")
    )
    with pytest.raises(Shed):
        await too_big
    assert queue.depth("batch") == 3
    fits = asyncio.create_task(
        queue.hold(Request(fleet, "fits"), "w0", "interactive", 500, 500, 800, None, "fits")
    )
    await asyncio.sleep(0)
    assert queue.depth("batch") == 2 and queue.depth("interactive") == 1  # the newest went
    with pytest.raises(Shed):
        await tasks[2]
    queue.limits = AdmissionConfig(enabled=False)
    await asyncio.wait_for(asyncio.gather(fits, *tasks[:2]), 1)


async def test_turning_the_queue_off_lets_what_it_holds_go(clock: Clock) -> None:
    fleet = _fleet("w0")
    _busy(fleet.workers["w0"])
    queue = _queue(fleet)
    task = await _hold(queue, Request(fleet, "held"), "w0", 500)
    queue.limits = AdmissionConfig(enabled=False)
    await asyncio.wait_for(task, 1)  # it goes as a new request would: chosen again
    assert queue.depth() == 0


async def test_a_session_under_way_goes_before_a_new_one_and_a_new_one_is_shed_sooner(
    clock: Clock,
) -> None:
    fleet = _fleet("w0")
    busy = _busy(fleet.workers["w0"])
    queue = _queue(fleet, queue_timeout_s=10.0, first_turn_queue_timeout_s=0.05)
    new, going = Request(fleet, "new"), Request(fleet, "going")
    first_turn = _first_turn(queue, new, "w0")
    await asyncio.sleep(0)
    under_way = await _hold(queue, going, "w0", 20_000)  # a missed turn: long prefill
    with pytest.raises(Shed):
        await asyncio.wait_for(first_turn, 1)  # its deadline (real time) ran out first
    assert queue.depth() == 1
    await _room_on(queue, busy)
    await under_way
    assert going.took == "w0" and new.took is None


async def test_between_a_new_session_and_one_under_way_the_one_under_way_goes_first(
    clock: Clock,
) -> None:
    fleet = _fleet("w0")
    busy = _busy(fleet.workers["w0"])
    queue = _queue(fleet)
    new, going = Request(fleet, "new"), Request(fleet, "going")
    tasks = [
        _first_turn(queue, new, "w0"),
        await _hold(queue, going, "w0", 20_000),
    ]
    assert await _released_order(queue, busy, [new, going], tasks) == ["going", "new"]


async def test_held_requests_are_asked_where_they_would_go_once_an_interval(
    clock: Clock,
) -> None:
    fleet = _fleet("w0", "w1")
    _busy(fleet.workers["w0"])
    queue = _queue(fleet)
    stays = Request(fleet, "stays", would_go="w0")
    task = await _hold(queue, stays, "w0", 500)  # w1 is idle, but it would rather wait
    for _ in range(5):  # first bytes and ends elsewhere: a pump each
        queue.notify()
        await asyncio.sleep(0)
    assert stays.asked == 1
    clock.now += 2 * queue_module.RECHECK_S
    queue.notify()
    await asyncio.sleep(0)
    assert stays.asked == 2
    task.cancel()


async def test_new_sessions_wait_at_the_door_while_a_session_under_way_waits(
    clock: Clock,
) -> None:
    fleet = _fleet("w0", "w1")
    on_w0 = _busy(fleet.workers["w0"])
    queue = _queue(fleet)
    w1 = fleet.workers["w1"]
    assert queue.goes_now(w1, 500, first_turn=True)  # nobody waits: the door is open
    going = await _hold(queue, Request(fleet, "going"), "w0", 500)
    # w1 has room, but a session under way waits on w0: a new session waits too.
    assert not queue.goes_now(w1, 500, first_turn=True)
    assert queue.goes_now(w1, 500, first_turn=False)
    new = Request(fleet, "new")
    door = _first_turn(queue, new, "w1")
    await asyncio.sleep(0)
    queue.notify()
    await asyncio.sleep(0)
    assert new.took is None  # w1 has room, the door is closed
    await _room_on(queue, on_w0)
    await going
    queue.notify()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert new.took == "w1"  # nobody under way waits now
    await door


async def test_without_the_door_a_new_session_takes_room_where_it_is(clock: Clock) -> None:
    fleet = _fleet("w0", "w1")
    _busy(fleet.workers["w0"])
    queue = _queue(fleet, door=False)
    going = await _hold(queue, Request(fleet, "going"), "w0", 500)
    assert queue.goes_now(fleet.workers["w1"], 500, first_turn=True)
    going.cancel()


async def test_a_batch_turn_under_way_goes_past_new_interactive_sessions_at_the_door(
    clock: Clock,
) -> None:
    fleet = _fleet("w0", "w1")
    on_w0 = _busy(fleet.workers["w0"])
    _busy(fleet.workers["w1"])
    queue = _queue(fleet)
    blocker = await _hold(queue, Request(fleet, "blocker"), "w1", 500)  # closes the door
    new = Request(fleet, "new")
    door = _first_turn(queue, new, "w0")
    batch = Request(fleet, "batch")
    batch_task = await _hold(queue, batch, "w0", 500, priority="batch")
    await _room_on(queue, on_w0)
    assert (batch.took, new.took) == ("w0", None)
    await batch_task
    for task in (blocker, door):
        task.cancel()


async def test_a_worker_holding_only_new_sessions_at_the_door_takes_a_turn_under_way(
    clock: Clock,
) -> None:
    # Found in review: new sessions held for the worker with room made it look busy, so
    # the turn under way (which closed the door) never moved there.
    fleet = _fleet("w0", "w1")
    _busy(fleet.workers["w0"])
    on_w1 = _busy(fleet.workers["w1"])
    queue = _queue(fleet)
    new = Request(fleet, "new", would_go="w0")
    new_task = _first_turn(queue, new, "w1")
    await asyncio.sleep(0)
    going = Request(fleet, "going", would_go="w1")
    going_task = await _hold(queue, going, "w0", 500)  # closes the door
    await _room_on(queue, on_w1)
    await asyncio.wait_for(going_task, 1)  # before the new session's 2 s are up
    assert (going.took, new.took) == ("w1", None)  # moved; the new session was not
    new_task.cancel()


async def test_batch_work_and_requests_of_no_session_leave_the_door_open(clock: Clock) -> None:
    fleet = _fleet("w0", "w1")
    _busy(fleet.workers["w0"])
    queue = _queue(fleet)
    batch = await _hold(queue, Request(fleet, "batch"), "w0", 500, priority="batch")
    anonymous = asyncio.create_task(
        queue.hold(Request(fleet, "x"), "w0", "interactive", 500, 500, 100, None, None)
    )
    await asyncio.sleep(0)
    assert queue.goes_now(fleet.workers["w1"], 500, first_turn=True)
    for task in (batch, anonymous):
        task.cancel()


async def test_a_change_keeps_its_own_keys_when_the_fleets_copy_comes_back_first(
    clock: Clock,
) -> None:
    queue = _queue(_fleet("w0"))
    mine = AdmissionConfig(enabled=True, batch_api_keys=("k",))

    async def publish(settings: Mapping[str, object], own: int) -> int:
        # The share loop read this change back from Redis while it was being written:
        # the fleet's copy, without this replica's batch_api_keys.
        queue.install(AdmissionConfig(enabled=True), own + 1)
        return own + 1

    queue.publisher = publish
    await queue.change({"enabled": True}, mine)
    assert queue.settings_version == 1 and queue.limits.batch_api_keys == ("k",)


async def test_the_reason_a_request_is_held_is_the_rule_it_failed(clock: Clock) -> None:
    fleet = _fleet("w0")
    worker = fleet.workers["w0"]
    queue = _queue(fleet, max_outstanding_per_worker=0, max_queued_prefill_s=1.0)
    assert queue.hold_reason(worker, 500) is None  # idle: anything goes
    Lease(worker, 80_000, int(RATE))  # one second of prefill queued, 80K tokens running
    assert queue.hold_reason(worker, 500) == "prefill"
    worker.queued_prefill_tokens = 0
    assert queue.hold_reason(worker, 30_000) == "kv"  # 110K past the 100K capacity
    assert queue.hold_reason(worker, 10_000) is None
    held = await _hold(queue, Request(fleet, "going"), "w0", 500)
    assert queue.hold_reason(worker, 10_000) == "behind"
    assert queue.hold_reason(fleet.workers["w0"], 10_000, first_turn=True) == "door"
    held.cancel()


async def test_a_request_that_can_no_longer_meet_the_first_token_target_is_shed(
    clock: Clock,
) -> None:
    """``ttft_target_s`` 0.1 s, prefill at 10,000 tokens/s: a request of 500 uncached
    tokens (0.05 s) may wait 0.05 s; one of 2,000 (0.2 s) cannot meet the target at all
    and keeps its class's deadline; batch work has no target."""
    fleet = _fleet("w0")
    busy = _busy(fleet.workers["w0"])
    queue = _queue(fleet, queue_timeout_s=10.0, ttft_target_s=0.1)
    short, long, batch = (Request(fleet, n) for n in ("short", "long", "batch"))
    short_task = await _hold(queue, short, "w0", 500)
    long_task = await _hold(queue, long, "w0", 2_000)
    batch_task = await _hold(queue, batch, "w0", 500, priority="batch")
    with pytest.raises(Shed) as shed:
        await asyncio.wait_for(short_task, 1)  # real time: its slack ran out
    assert shed.value.reason == "ttft_target"
    await asyncio.sleep(0.1)  # past the target: the other two still wait
    assert queue.depth() == 2
    await _room_on(queue, busy)
    await long_task
    assert long.took == "w0"
    assert long.lease is not None
    await _room_on(queue, long.lease)
    await batch_task
    assert batch.took == "w0"


async def test_the_door_stays_shut_while_most_turns_under_way_lately_had_to_wait(
    clock: Clock,
) -> None:
    """``door_pressure`` 0.5 over ``door_window_s`` 30: turns under way held now and
    then leave the door open; half of them held shuts it, though none waits now; once
    those turns are older than the window it opens again. Fewer than
    ``MIN_PRESSURE_TURNS`` turns say nothing."""
    fleet = _fleet("w0", "w1")
    w1 = fleet.workers["w1"]
    queue = _queue(fleet, door_pressure=0.5, door_window_s=30.0)
    queue.went_at_once("interactive", True, "new")  # first turns do not count
    queue.went_at_once("batch", False, "c")  # nor does batch work

    async def one_held(name: str) -> None:
        busy = _busy(fleet.workers["w0"])
        request = Request(fleet, name)
        task = await _hold(queue, request, "w0", 500)
        await _room_on(queue, busy)
        await task
        assert queue.depth() == 0 and request.lease is not None
        request.lease.release()

    for name in "abcd":
        await one_held(name)
    assert queue.goes_now(w1, 500, first_turn=True)  # 4 of 4 waited: too few to say
    for session in "efghij":
        queue.went_at_once("interactive", False, session)
    assert queue.goes_now(w1, 500, first_turn=True)  # 4 of 10
    await one_held("k")
    assert queue.goes_now(w1, 500, first_turn=True)  # 5 of 11
    await one_held("l")
    assert queue.hold_reason(w1, 500, first_turn=True) == "door"  # 6 of 12
    assert queue.goes_now(w1, 500, first_turn=False)
    clock.now += 31.0
    assert queue.goes_now(w1, 500, first_turn=True)


async def test_new_sessions_at_a_shut_door_are_not_ahead_of_a_turn_under_way(
    clock: Clock,
) -> None:
    """A first turn waits at the shut door for w1, which has room: a turn of a session
    under way chosen for w1 goes at once (it is not held behind it, which would also
    count it as a turn that had to wait)."""
    fleet = _fleet("w0", "w1")
    _busy(fleet.workers["w0"])
    queue = _queue(fleet)
    going = await _hold(queue, Request(fleet, "going"), "w0", 500)  # shuts the door
    new = Request(fleet, "new")
    door = _first_turn(queue, new, "w1")
    await asyncio.sleep(0)
    assert queue.held_for("w1") == 1 and new.took is None
    assert queue.hold_reason(fleet.workers["w1"], 500) is None
    assert queue.hold_reason(fleet.workers["w1"], 500, first_turn=True) == "door"
    for task in (going, door):
        task.cancel()


def test_the_target_leaves_a_request_its_slack_after_its_own_prefill() -> None:
    limits = AdmissionConfig(enabled=True, ttft_target_s=5.0)
    assert limits.target_slack_s("interactive", 1.5) == 3.5
    assert limits.target_slack_s("interactive", 5.0) is None  # cannot meet it anyway
    assert limits.target_slack_s("batch", 1.5) is None
    assert AdmissionConfig(enabled=True).target_slack_s("interactive", 1.5) is None
