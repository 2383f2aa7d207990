"""Metrics of the shared state, on the router's registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.replication.remote import BadEntries

RESYNC_REASONS = ("start", "redis_error", "outbox_overflow", "stream_gap", "repaired")
SYNC_LOOPS = ("publish", "subscribe", "share")
REDIS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class RedisMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.up = Gauge(
            "kvrouter_redis_up",
            "1 while the shared state in Redis is reachable.",
            registry=registry,
        )
        self.errors = Counter(
            "kvrouter_redis_errors", "Failed Redis operations.", ["op"], registry=registry
        )
        self.seconds = Histogram(
            "kvrouter_redis_operation_seconds",
            "Redis operation latency (background, never on a request).",
            ["op"],
            buckets=REDIS_BUCKETS,
            registry=registry,
        )
        self.events = Counter(
            "kvrouter_redis_index_events",
            "Index changes sent to and received from other replicas.",
            ["direction"],
            registry=registry,
        )
        self.replicas = Gauge(
            "kvrouter_redis_replicas",
            "Live router replicas sharing this state, this one included (as of the last "
            "load share).",
            registry=registry,
        )
        self.resyncs = Counter(
            "kvrouter_redis_resyncs",
            "Full resynchronisations with Redis (its copy read in, this replica's written "
            "back), by what asked for one.",
            ["reason"],
            registry=registry,
        )
        self.outbox_dropped = Counter(
            "kvrouter_redis_outbox_dropped_events",
            "Index changes dropped unsent because the outbox was full (Redis away); a "
            "resync then writes this replica's whole index back.",
            registry=registry,
        )
        self.loop_failures = Counter(
            "kvrouter_redis_loop_failures",
            "Unexpected failures of a shared-state loop (publish, subscribe, share), each "
            "logged and the loop started again after a backoff.",
            ["loop"],
            registry=registry,
        )
        self.bad_entries = BadEntries(registry)
        for reason in RESYNC_REASONS:
            self.resyncs.labels(reason)
        for loop in SYNC_LOOPS:
            self.loop_failures.labels(loop)
        for op in ("publish", "subscribe", "load", "resync", "policy"):
            self.errors.labels(op)
        for direction in ("in", "out"):
            self.events.labels(direction)


PATH_OPS = ("lookup", "reserve", "record")
PATH_RESULTS = ("ok", "timeout", "error", "late")


class PathMetrics:
    """The shared state on requests' paths (``router.replication.path``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.operations = Counter(
            "kvrouter_redis_path_operations",
            "Redis round trips made on a request's path (read-your-writes): lookup (no "
            "local worker held the session's history), reserve (the decision, before "
            "forwarding), record (the reply's blocks, before the final chunk); by result "
            "(timeout: past state.path_timeout_s, the request went on without it; late: a "
            "write that timed out and then landed, off the request's path); and "
            "background/dropped: a withdrawal or repair not sent, with too many waiting.",
            ["op", "result"],
            registry=registry,
        )
        self.seconds = Histogram(
            "kvrouter_redis_path_seconds",
            "Time a request waited on Redis, per round trip.",
            ["op"],
            buckets=REDIS_BUCKETS,
            registry=registry,
        )
        self.skipped = Counter(
            "kvrouter_redis_path_lookups_skipped",
            "Requests that did not ask Redis: some local worker held the session's history.",
            registry=registry,
        )
        for op in PATH_OPS:
            self.seconds.labels(op)
            for result in PATH_RESULTS:
                self.operations.labels(op, result)
