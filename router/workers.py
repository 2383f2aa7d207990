"""Workers as the router tracks them: address, health, models, load and learned speed.

Load accounting is exact: a ``Lease`` is taken before dispatch and released exactly once
on every exit path (success, upstream error, client disconnect, timeout); releasing twice
is a no-op. Broken accounting is what makes cache-aware routers collapse onto one worker.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

# Prefill speed assumed for a worker before any TTFT has been observed (tokens/s).
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
# Weight of a new TTFT observation in the prefill-rate moving average.
RATE_EWMA_ALPHA = 0.2
# Observations below this many prefilled tokens say more about overhead than speed.
MIN_RATE_SAMPLE_TOKENS = 256


@dataclass(slots=True)
class Worker:
    name: str
    url: str
    capacity_tokens: int
    healthy: bool = True
    models: frozenset[str] = frozenset()
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    queued_prefill_tokens: int = 0
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    rate_samples: int = 0

    def serves(self, model: str) -> bool:
        # Before the first /v1/models answer a worker is assumed to serve any model.
        return not self.models or model in self.models

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Learn the prefill rate from one TTFT: ``tokens`` prefilled in ``seconds``."""
        if tokens < MIN_RATE_SAMPLE_TOKENS or seconds <= 0:
            return
        sample = tokens / seconds
        if self.rate_samples == 0:
            self.prefill_tokens_per_s = sample
        else:
            self.prefill_tokens_per_s += RATE_EWMA_ALPHA * (sample - self.prefill_tokens_per_s)
        self.rate_samples += 1


class Lease:
    """One request's share of a worker's load."""

    __slots__ = ("_prefill_open", "_released", "prefill_tokens", "tokens", "worker")

    def __init__(self, worker: Worker, tokens: int, prefill_tokens: int) -> None:
        self.worker = worker
        self.tokens = tokens
        self.prefill_tokens = prefill_tokens
        self._released = False
        self._prefill_open = True
        worker.outstanding_requests += 1
        worker.outstanding_tokens += tokens
        worker.queued_prefill_tokens += prefill_tokens

    def prefill_done(self) -> None:
        """The first byte arrived: this request's prefill is no longer queued work."""
        if self._prefill_open:
            self._prefill_open = False
            self.worker.queued_prefill_tokens -= self.prefill_tokens

    def release(self) -> None:
        if self._released:
            return
        self.prefill_done()
        self._released = True
        self.worker.outstanding_requests -= 1
        self.worker.outstanding_tokens -= self.tokens

    @property
    def released(self) -> bool:
        return self._released


@dataclass(slots=True)
class Fleet:
    """The workers this router routes to, by name."""

    workers: dict[str, Worker] = field(default_factory=dict)

    def add(self, worker: Worker) -> None:
        self.workers[worker.name] = worker

    def remove(self, name: str) -> None:
        self.workers.pop(name, None)

    def all(self) -> list[Worker]:
        return list(self.workers.values())

    def eligible(self, model: str, exclude: Iterable[str] = ()) -> list[Worker]:
        excluded = set(exclude)
        return [w for w in self.workers.values()
                if w.healthy and w.name not in excluded and w.serves(model)]

    def models(self) -> set[str]:
        return {m for w in self.workers.values() for m in w.models}

    def serves(self, model: str) -> bool:
        return any(w.serves(model) for w in self.workers.values())
