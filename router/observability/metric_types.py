"""Counters and histograms for what every request writes, kept as plain floats.

prometheus_client's ``Counter`` and ``Histogram`` take a lock on every ``inc`` and
``observe`` (they may be written from any thread): about 1 µs each, and a request writes
a dozen of them. The router writes these only from its event loop, so a child here is a
float added to without a lock, and the registry reads it at scrape time through
``collect``. The exposition is prometheus_client's own (the same ``_total``, ``_bucket``,
``_sum``, ``_count`` and ``_created`` samples as its classes give); only the label API
the router uses is offered: ``labels(*values)``, ``remove_by_labels``, ``inc``,
``observe``.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class CounterChild:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class HistogramChild:
    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self._bounds, value)] += 1  # le: bound included
        self.sum += value


class _Family(Collector):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], CounterChild | HistogramChild] = {}
        registry.register(self)

    def remove_by_labels(self, labels: Mapping[str, str]) -> None:
        """Drops every child whose labels include ``labels``."""
        positions = [(self.labelnames.index(k), v) for k, v in labels.items()]
        for key in [k for k in self._children if all(k[i] == v for i, v in positions)]:
            del self._children[key]

    def _child(self, values: tuple[str, ...]) -> CounterChild | HistogramChild:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._new()
        return child

    def _new(self) -> CounterChild | HistogramChild:
        raise NotImplementedError


class LoopCounter(_Family):
    def labels(self, *values: str) -> CounterChild:
        child = self._child(values)
        assert isinstance(child, CounterChild)
        return child

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def _new(self) -> CounterChild:
        return CounterChild()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            assert isinstance(child, CounterChild)
            family.add_metric(values, child.value, created=child.created)
        yield family


class LoopHistogram(_Family):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        if registry is None:
            raise ValueError("a registry is required")
        bounds = tuple(float(b) for b in buckets if not math.isinf(b))
        if list(bounds) != sorted(bounds) or not bounds:
            raise ValueError(f"{name}: buckets must be a sorted, non-empty sequence")
        self._bounds = bounds
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> HistogramChild:
        child = self._child(values)
        assert isinstance(child, HistogramChild)
        return child

    def observe(self, value: float) -> None:
        self.labels().observe(value)

    def _new(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def collect(self) -> Iterator[HistogramMetricFamily | GaugeMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        created = GaugeMetricFamily(
            self.name + "_created", self.documentation, labels=self.labelnames
        )
        edges = [*(str(floatToGoString(b)) for b in self._bounds), "+Inf"]  # type: ignore[no-untyped-call]
        for values, child in list(self._children.items()):
            assert isinstance(child, HistogramChild)
            running, buckets = 0, []
            for edge, count in zip(edges, child.counts, strict=True):
                running += count
                buckets.append((edge, float(running)))
            family.add_metric(values, buckets, child.sum)
            created.add_metric(values, child.created)
        yield family
        yield created
