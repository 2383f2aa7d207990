"""Simulated engines, workload traces and replay benchmarks for kvrouter."""
