"""What the router's KV event subscriptions count, per worker, on the app's registry."""

from __future__ import annotations

from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Histogram

ReplayResult = Literal["complete", "incomplete", "failed"]
REPLAY_RESULTS: tuple[ReplayResult, ...] = ("complete", "incomplete", "failed")
# Why a rank's announced blocks were dropped: the engine restarted (its sequence began
# again), a gap could not be replayed, or a batch could not be read.
ResetReason = Literal["restart", "gap", "malformed"]
RESET_REASONS: tuple[ResetReason, ...] = ("restart", "gap", "malformed")
# The CPU tier's stores and removals (its engine's offloading connector) apart.
EVENT_TYPES = ("stored", "removed", "cleared", "offload_stored", "offload_removed")
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class KvEventMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches = Counter(
            "kvrouter_kv_event_batches",
            "KV event batches applied from the worker's engine (live or replayed).",
            ["worker"],
            registry=registry,
        )
        self.events = Counter(
            "kvrouter_kv_events",
            "KV events applied, by type: stored, removed, cleared (the GPU's cache), "
            "offload_stored, offload_removed (its CPU tier).",
            ["worker", "type"],
            registry=registry,
        )
        self.gaps = Counter(
            "kvrouter_kv_event_gaps",
            "Gaps in a worker's event sequence (messages the subscriber never received).",
            ["worker"],
            registry=registry,
        )
        self.replays = Counter(
            "kvrouter_kv_event_replays",
            "Replays asked of the worker's replay endpoint, by result: complete, "
            "incomplete (the engine no longer had every missed batch) or failed.",
            ["worker", "result"],
            registry=registry,
        )
        self.resets = Counter(
            "kvrouter_kv_event_resets",
            "Times a rank's announced blocks were dropped and rebuilt from later events, by "
            "reason: restart, gap (not replayed), malformed (a batch that could not be read).",
            ["worker", "reason"],
            registry=registry,
        )
        self.lag = Histogram(
            "kvrouter_kv_event_lag_seconds",
            "From an engine publishing a batch (its timestamp) to the router applying it: "
            "how far the router's view of the worker's cache trails the engine.",
            ["worker"],
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        self.rejected = Counter(
            "kvrouter_kv_event_rejected_blocks",
            "Blocks announced with a block size that is not a whole number of the router's "
            "(prefix.block_bytes / 4 tokens): the worker stays approximate.",
            ["worker"],
            registry=registry,
        )

    def worker_added(self, worker: str) -> None:
        """Every series of the worker exists from its subscription on, at 0."""
        self.batches.labels(worker)
        self.lag.labels(worker)
        self.gaps.labels(worker)
        self.rejected.labels(worker)
        for kind in EVENT_TYPES:
            self.events.labels(worker, kind)
        for result in REPLAY_RESULTS:
            self.replays.labels(worker, result)
        for reason in RESET_REASONS:
            self.resets.labels(worker, reason)

    def worker_removed(self, worker: str) -> None:
        for single in (self.batches, self.lag, self.gaps, self.rejected):
            single.remove(worker)
        for kind in EVENT_TYPES:
            self.events.remove(worker, kind)
        for result in REPLAY_RESULTS:
            self.replays.remove(worker, result)
        for reason in RESET_REASONS:
            self.resets.remove(worker, reason)
