"""What the router learns from responses: prefill speed and how much each cache holds.

``PrefillRate``: tokens prefilled per second, from each streamed response's TTFT and the
engine-reported uncached tokens (prompt - cached, plus the prefill queued ahead of it).
One fleet-wide moving average: fleets are usually homogeneous, and one rate fed by every
response settles far faster and noisier workers than a rate per worker would.

``WorkerSpeeds``: each worker's prefill speed as a multiple of the fleet-wide rate, from
the same observations, moving slowly and bounded (a quarter to four times), so one worker
on slower hardware, or one throttled, is seen as slower without per-worker noise moving
sessions off their caches: the ratio starts at 1, a worker's own samples only tilt it,
only requests whose own prefill is at least the prefill queued ahead of them count, and
ratios within a factor of 1.5 of 1 are taken as 1.

``Learner``: the three above and the sessions' turn outcomes
(``router.observability.outcomes``) behind one observer: every finished dispatch with
usage is handed to ``Learner.learn``.

``ResidencyCalibrator``: the residency model is sized from the engine's nominal KV
capacity, but blocks pinned by running requests, preemptions and timing make the engine
hold less than that. When the engine reports fewer cached tokens than the model predicted,
the worker's modelled capacity shrinks a step; when it reports at least as many, it grows
back a smaller step, never past the nominal capacity. Predictions then stay honest under
cache pressure, which is when they matter. Workers in exact mode (their engines' KV
events) are not calibrated: their evictions are announced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.clock import monotonic
from router.fleet.workers import Fleet, Worker
from router.index.residency import PrefixIndex
from router.observability.metrics import RouterMetrics
from router.observability.outcomes import (
    SessionMemory,
    SessionTracker,
    Waiting,
    classify,
    read_back,
)
from router.routing.returns import ResidentSessions, ReturnTimes

if TYPE_CHECKING:
    from router.routing.dispatch import Dispatch, EngineUsage

DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
RATE_EWMA_ALPHA = 0.1
# Observations below this many prefilled tokens say more about overhead than speed.
MIN_RATE_SAMPLE_TOKENS = 512

# Samples before the fleet-wide rate is a yardstick for single workers.
SETTLED_RATE_SAMPLES = 20
# Per-worker speed ratios: a slower average than the fleet rate's, and bounds.
SPEED_EWMA_ALPHA = 0.05
MIN_SPEED_RATIO = 0.25
MAX_SPEED_RATIO = 4.0
# Ratios closer to 1 than this factor count as 1: prefills sharing a step and decode
# batches move a worker's observed rate by tens of percent under ordinary load, while
# hardware differences (an A100 among H100s prefills at a third) are larger.
SPEED_DEADBAND = 1.5

# Over-prediction beyond this share of the prompt counts as the model being too generous.
CALIBRATION_TOLERANCE = 0.1
SHRINK_STEP = 0.03
GROW_STEP = 0.01
MIN_CAPACITY_SHARE = 0.1


class PrefillRate:
    __slots__ = ("samples", "tokens_per_s")

    def __init__(self, initial: float = DEFAULT_PREFILL_TOKENS_PER_S) -> None:
        self.tokens_per_s = initial
        self.samples = 0

    @property
    def settled(self) -> bool:
        """Enough samples that the rate says something about this fleet."""
        return self.samples >= SETTLED_RATE_SAMPLES

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < MIN_RATE_SAMPLE_TOKENS or seconds <= 0:
            return
        sample = tokens / seconds
        if self.samples == 0:
            self.tokens_per_s = sample
        else:
            self.tokens_per_s += RATE_EWMA_ALPHA * (sample - self.tokens_per_s)
        self.samples += 1

    def blend(self, others: list[tuple[float, int]]) -> None:
        """Fold in other replicas' rates (rate, samples), weighted by their samples."""
        weighted = [(r, n) for r, n in others if n > 0 and r > 0]
        if not weighted:
            return
        total = self.samples + sum(n for _, n in weighted)
        self.tokens_per_s = (
            self.tokens_per_s * self.samples + sum(r * n for r, n in weighted)
        ) / total
        if self.samples == 0:
            self.samples = 1  # a shared rate is no longer the default guess


class WorkerSpeeds:
    __slots__ = ("_ratio",)

    def __init__(self) -> None:
        self._ratio: dict[str, float] = {}

    def ratio(self, worker: str) -> float:
        """The learned ratio, or 1 while it is within ``SPEED_DEADBAND`` of 1."""
        ratio = self.learned(worker)
        return ratio if not 1 / SPEED_DEADBAND < ratio < SPEED_DEADBAND else 1.0

    def learned(self, worker: str) -> float:
        return self._ratio.get(worker, 1.0)

    def observe(self, worker: str, tokens: int, seconds: float, fleet_rate: float) -> None:
        if tokens < MIN_RATE_SAMPLE_TOKENS or seconds <= 0 or fleet_rate <= 0:
            return
        sample = tokens / seconds / fleet_rate
        ratio = self.learned(worker)
        ratio += SPEED_EWMA_ALPHA * (sample - ratio)
        self._ratio[worker] = min(MAX_SPEED_RATIO, max(MIN_SPEED_RATIO, ratio))

    def reset(self, worker: str) -> None:
        self._ratio.pop(worker, None)


class ResidencyCalibrator:
    def __init__(self, index: PrefixIndex, block_tokens: int) -> None:
        self._index = index
        self._block_tokens = block_tokens
        self._share: dict[str, float] = {}

    def share(self, worker: str) -> float:
        """The fraction of its nominal capacity the worker is modelled to hold."""
        return self._share.get(worker, 1.0)

    def observe(self, worker: Worker, predicted: int, cached: int, prompt: int) -> None:
        if prompt <= 0 or self._index.prefix_mode(worker.name) == "exact":
            return  # an exact worker's engine says what it evicted: nothing to calibrate
        share = self.share(worker.name)
        if predicted - cached > CALIBRATION_TOLERANCE * prompt:
            share = max(MIN_CAPACITY_SHARE, share * (1 - SHRINK_STEP))
        elif cached >= predicted:
            share = min(1.0, share * (1 + GROW_STEP))
        else:
            return
        self._share[worker.name] = share
        blocks = max(1, int(worker.capacity_tokens * share) // self._block_tokens)
        self._index.resize_worker(worker.name, blocks)

    def reset(self, worker: str) -> None:
        self._share.pop(worker, None)


class Learner:
    """What the router learns from each finished request: the fleet's prefill rate, each
    worker's speed, the residency calibration, and what happened to each session's
    prefix (reported as turn outcomes)."""

    def __init__(
        self, fleet: Fleet, index: PrefixIndex, metrics: RouterMetrics, block_tokens: int
    ) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self.prefill_rate = PrefillRate()
        self.speeds = WorkerSpeeds()
        self.calibrator = ResidencyCalibrator(index, block_tokens)
        self.sessions = SessionTracker()
        self.returns = ReturnTimes()
        self.resident_sessions = ResidentSessions(self.returns)

    def modelled_capacity(self, worker: Worker) -> int:
        """The tokens ``worker``'s cache is modelled to hold: its calibrated share."""
        return int(worker.capacity_tokens * self.calibrator.share(worker.name))

    def prefill_tokens_per_s(self, worker: str) -> float:
        """How fast ``worker`` is taken to prefill: the fleet's rate times its own ratio."""
        return self.prefill_rate.tokens_per_s * self.speeds.ratio(worker)

    def forget(self, worker: str) -> None:
        """The worker left or lost its cache: what was learnt of it no longer holds."""
        self.calibrator.reset(worker)
        self.speeds.reset(worker)
        self.resident_sessions.forget(worker)

    def migrate(self, source: str, target: str, target_epoch: int) -> None:
        """``source``'s cache was restored on ``target``: its sessions are there now."""
        self.calibrator.reset(source)
        self.sessions.migrate(source, target, target_epoch)
        self.resident_sessions.migrate(source, target)

    def learn(self, dispatch: Dispatch, usage: EngineUsage) -> None:
        uncached = max(0, usage.prompt_tokens - usage.cached_tokens)
        # A turn that read its prefix back from a CPU tier teaches nothing of prefill
        # speed: its TTFT holds the reload.
        reloaded = read_back(usage.cached_tokens, dispatch.matched, dispatch.offloaded)
        if dispatch.ttft is not None and not reloaded:
            prefilled = dispatch.queued_before + uncached
            self.prefill_rate.observe(prefilled, dispatch.ttft)
            if dispatch.queued_before <= uncached and self.prefill_rate.settled:
                # A TTFT measures the queue ahead (counted in ``prefilled``, but part of it
                # may have been prefilled already) as well as the request: only requests
                # whose own prefill is at least half of it teach how fast the worker is,
                # and only against a fleet rate that is no longer the first guess. (Only
                # requests that found no queue at all were too few: a slower worker was
                # still taken for an equal one after half the demo's turns.)
                self.speeds.observe(
                    dispatch.worker.name, prefilled, dispatch.ttft, self.prefill_rate.tokens_per_s
                )
            self._metrics.prefill_rate.set(self.prefill_rate.tokens_per_s)
        predicted = min(dispatch.decision.predicted_cached_tokens, usage.prompt_tokens)
        worker = dispatch.worker
        self.calibrator.observe(worker, predicted, usage.cached_tokens, usage.prompt_tokens)
        self._metrics.worker(worker.name).residency_share.set(self.calibrator.share(worker.name))
        self._report_turn(dispatch, usage, predicted)

    def _report_turn(self, dispatch: Dispatch, usage: EngineUsage, predicted: int) -> None:
        key = dispatch.route.session_key
        epochs = {w.name: w.epoch for w in self._fleet.all()}
        report = classify(
            self.sessions.get(key),
            dispatch.worker.name,
            epochs,
            usage.prompt_tokens,
            usage.cached_tokens,
            dispatch.best_match,
            predicted,
            dispatch.matched,
            dispatch.offloaded,
        )
        metrics = self._metrics
        metrics.counter(metrics.turns, report.outcome).inc()
        if report.cause is not None:
            metrics.counter(metrics.lost_turns, report.cause).inc()
            metrics.counter(metrics.lost_tokens, report.cause).inc(report.lost_tokens)
        if dispatch.ttft is not None:
            metrics.histogram(metrics.turn_ttft, report.outcome).observe(dispatch.ttft)
        self.turn_ended(dispatch, usage.prompt_tokens + usage.completion_tokens)

    def turn_ended(self, dispatch: Dispatch, history_tokens: int) -> None:
        """A turn of ``dispatch``'s session ended well: where it ran, how long its history
        is, and what it left the session waiting on, for the session's next turn."""
        key = dispatch.route.session_key
        if key is None:
            return
        waiting: Waiting = "finished" if dispatch.request.ends_session else dispatch.turn_end
        metrics = self._metrics
        metrics.counter(metrics.session_turn_ends, waiting).inc()
        worker = dispatch.worker
        now = monotonic()
        memory = SessionMemory(
            worker.name, worker.epoch, history_tokens, ended_at=now, waiting_on=waiting
        )
        self.sessions.remember(key, memory)
        self.returns.ended(waiting)
        if self._fleet.workers.get(worker.name) is worker:  # not removed meanwhile
            capacity = self.modelled_capacity(worker)
            self.resident_sessions.ended(worker.name, key, history_tokens, waiting, now, capacity)

    def worker_of(self, session: str | None) -> str | None:
        """The worker session ``session``'s last turn ran on, if it is remembered."""
        memory = self.sessions.get(session)
        return None if memory is None else memory.worker

    def session_returns(self, key: str | None) -> None:
        """A request of session ``key`` arrives: how long the session was away since its
        last turn ended is observed by what that turn left it waiting on."""
        if key is None:
            return
        self.resident_sessions.returned(key)
        memory = self.sessions.returning(key)
        if memory is not None and memory.ended_at is not None:
            away = max(0.0, monotonic() - memory.ended_at)
            self.returns.returned(memory.waiting_on, away)
            metrics = self._metrics
            metrics.histogram(metrics.session_return, memory.waiting_on).observe(away)

    def returning_tokens(self, worker: str, evicted_tokens: float, now: float) -> float:
        """Of the ``evicted_tokens`` a placement would push out of ``worker``'s cache, how
        many their sessions are expected to come back for (``router.routing.returns``)."""
        if evicted_tokens <= 0:
            return 0.0
        return self.resident_sessions.returning_tokens(worker, evicted_tokens, now)
