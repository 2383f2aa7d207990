"""Comparisons of routers on one fleet and one trace: ``demo``'s loop, and the peers,
replicas, matrix, sweep, agreement and APIs benchmarks built on it."""
