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
from router import request_log
from router.clock import monotonic
from router.learning import Learner
from router.metrics import RouterMetrics
from router.workers import Fleet

if TYPE_CHECKING:
    from router.routing import Dispatch, EngineUsage


class Recorder:
    def __init__(
        self, fleet: Fleet, metrics: RouterMetrics, learner: Learner, log_requests: bool = False
    ) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self.learner = learner
        self.log_requests = log_requests

    def first_byte(self, dispatch: Dispatch, ttft: float) -> None:
        self._metrics.ttft.labels(dispatch.worker.name).observe(ttft)

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
        worker, metrics = dispatch.worker.name, self._metrics
        latency = monotonic() - dispatch.arrived
        model = self._fleet.model_label(dispatch.request.model)
        metrics.requests.labels(model, worker, outcome).inc()
        metrics.latency.labels(worker).observe(latency)
        metrics.prompt_tokens.labels(worker).inc(
            dispatch.route.prompt_tokens
            if reported_prompt_tokens is None
            else reported_prompt_tokens
        )
        if usage is not None:
            metrics.engine_cached_tokens.labels(worker).inc(usage.cached_tokens)
            metrics.usage_prompt_tokens.labels(worker).inc(usage.prompt_tokens)
        if self.log_requests:
            request_log.write(
                request_log.request_line(dispatch, outcome, usage, latency, dispatch.attempt)
            )
