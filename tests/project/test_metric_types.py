"""The lock-free counters and histograms expose exactly what prometheus_client's own
classes expose for the same writes (created timestamps aside)."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from router.observability.metric_types import LoopCounter, LoopHistogram

BUCKETS = (0.00005, 0.001, 0.5, 1.0, 2560.0)


def exposition(registry: CollectorRegistry) -> str:
    text = generate_latest(registry).decode()
    return re.sub(r"(_created(\{[^}]*\})?) \S+", r"\1 T", text)


def test_counter_and_histogram_expose_what_prometheus_client_does() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    pairs = [
        (
            LoopCounter("x_requests", "Requests.", ["worker", "outcome"], registry=ours),
            Counter("x_requests", "Requests.", ["worker", "outcome"], registry=theirs),
        ),
    ]
    histograms = (
        LoopHistogram("x_seconds", "Seconds.", ["worker"], buckets=BUCKETS, registry=ours),
        Histogram("x_seconds", "Seconds.", ["worker"], buckets=BUCKETS, registry=theirs),
    )
    unlabelled = (
        LoopHistogram("x_decision_seconds", "D.", buckets=BUCKETS, registry=ours),
        Histogram("x_decision_seconds", "D.", buckets=BUCKETS, registry=theirs),
    )
    for counter in pairs[0]:
        counter.labels("w0", "success").inc()
        counter.labels("w0", "success").inc(2.5)
        counter.labels("w1", "timeout").inc()
    for histogram in histograms:
        for value in (0.00005, 0.0002, 0.5, 0.7, 3000.0, 1.0):  # bounds included in le
            histogram.labels("w0").observe(value)
        histogram.labels("w1").observe(0.01)
    for histogram in unlabelled:
        histogram.observe(0.002)
    assert exposition(ours) == exposition(theirs)

    for metric in (pairs[0][0], pairs[0][1], histograms[0], histograms[1]):
        metric.remove_by_labels({"worker": "w0"})
    assert exposition(ours) == exposition(theirs)
    assert 'worker="w0"' not in exposition(ours)


def test_label_count_and_negative_increments_are_refused() -> None:
    counter = LoopCounter("y", "Y.", ["worker"], registry=CollectorRegistry())
    with pytest.raises(ValueError):
        counter.labels("a", "b")
    with pytest.raises(ValueError):
        counter.labels("a").inc(-1)
