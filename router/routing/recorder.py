"""Where a request's end is told: one observer for the metrics, the request log and the
learner, so that what happened to a request is written down in one place.

``Dispatch`` calls ``first_byte`` when the worker's first chunk arrives and ``finished``
once, when a served request ends (success, refusal, a failure after the first byte, the
client leaving). An attempt that failed before the first byte is not a request's end:
the proxy retries it and counts the request's final failure itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from policies.base import Outcome
from router.clock import monotonic
from router.fleet.workers import Fleet
from router.observability.metrics import RouterMetrics
from router.routing import request_log
from router.routing.learning import Learner
from router.wire.kinds import Kind

if TYPE_CHECKING:
    from router.routing.dispatch import Dispatch, EngineUsage


class Recorder:
    def __init__(
        self, fleet: Fleet, metrics: RouterMetrics, learner: Learner, log_requests: bool = False
    ) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self.learner = learner
        self.log_requests = log_requests

    def first_byte(self, dispatch: Dispatch, ttft: float) -> None:
        self._metrics.worker(dispatch.worker.name).ttft.observe(ttft)

    def retried(self, worker: str) -> None:
        """A dispatch is retried elsewhere after failing on ``worker``."""
        self._metrics.worker(worker).retries.inc()

    def gave_up(self, model: str, api: Kind, worker: str, outcome: Outcome) -> None:
        """No worker served the request: its last attempt, on ``worker``, ended it."""
        label = self._fleet.model_label(model)
        self._metrics.worker(worker).requests(label, outcome).inc()
        self._metrics.counter(self._metrics.api_requests, api, outcome).inc()

    def finished(
        self,
        dispatch: Dispatch,
        outcome: Outcome,
        usage: EngineUsage | None,
        reported_prompt_tokens: int | None,
    ) -> None:
        """``usage``: what the engine reported (None without cached tokens, e.g. vLLM
        without --enable-prompt-tokens-details); ``reported_prompt_tokens`` its prompt
        count when it gave one."""
        if outcome == "success" and usage is not None:
            self.learner.learn(dispatch, usage)
        elif outcome == "success":  # no usage: the turn's end is known all the same
            self.learner.turn_ended(
                dispatch, reported_prompt_tokens or dispatch.route.prompt_tokens
            )
        series = self._metrics.worker(dispatch.worker.name)
        latency = monotonic() - dispatch.arrived
        series.requests(self._fleet.model_label(dispatch.request.model), outcome).inc()
        series.latency.observe(latency)
        series.prompt_tokens.inc(
            dispatch.route.prompt_tokens
            if reported_prompt_tokens is None
            else reported_prompt_tokens
        )
        metrics, api = self._metrics, dispatch.request.kind
        metrics.counter(metrics.api_requests, api, outcome).inc()
        if usage is not None:
            series.engine_cached_tokens.inc(usage.cached_tokens)
            series.usage_prompt_tokens.inc(usage.prompt_tokens)
            metrics.counter(metrics.api_engine_cached_tokens, api).inc(usage.cached_tokens)
            metrics.counter(metrics.api_usage_prompt_tokens, api).inc(usage.prompt_tokens)
        if self.log_requests:
            request_log.write(
                request_log.request_line(dispatch, outcome, usage, latency, dispatch.attempt)
            )
