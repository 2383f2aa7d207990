"""``bench replicas``'s own arithmetic: load imbalance, histogram quantiles, the runs it
sets up and how the replay spreads requests over replicas."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from bench.compare.demo import DemoConfig
from bench.compare.replicas import ReplicaRuns, bucket_quantile, replica_specs
from bench.replay.client import ChatClient
from bench.replay.result import RequestRecord, load_imbalance
from router.cli import build_parser
from router.cli.serve import flag_overrides


def record(worker: str, prompt: int, cached: int) -> RequestRecord:
    return RequestRecord("s", 1, 0.0, 0.1, 0.2, prompt, cached, cached, 1, worker, None, 200)


def test_load_imbalance_is_the_coefficient_of_variation_across_workers() -> None:
    even = [record("a", 100, 0), record("b", 100, 0)]
    assert load_imbalance(even) == (0.0, 0.0)
    # a: 3 requests, 300 tokens prefilled; b: 1 request, 100 cached of 200.
    skewed = [record("a", 100, 0)] * 3 + [record("b", 200, 100)]
    requests_cov, prefill_cov = load_imbalance(skewed)
    assert requests_cov == pytest.approx(0.5)  # mean 2, deviation 1
    assert prefill_cov == pytest.approx(0.5)  # mean 200, deviation 100
    assert load_imbalance([record("a", 1, 0)]) == (None, None)


def test_bucket_quantile_interpolates_as_prometheus_does() -> None:
    buckets = {0.001: 50.0, 0.002: 90.0, 0.005: 100.0, float("inf"): 100.0}
    assert bucket_quantile(buckets, 0.5) == pytest.approx(0.001)
    assert bucket_quantile(buckets, 0.7) == pytest.approx(0.0015)
    assert bucket_quantile(buckets, 0.99) == pytest.approx(0.0047)
    assert bucket_quantile({0.001: 0.0, float("inf"): 0.0}, 0.99) is None
    assert bucket_quantile({0.001: 1.0, float("inf"): 2.0}, 0.99) == 0.001


def test_replica_runs_and_their_contrasts() -> None:
    config = DemoConfig(out=Path("/tmp/unused"))
    runs = ReplicaRuns(
        counts=[1, 2], assigns=["random", "round_robin"], mirrors_only=[2], unshared=[2]
    )
    specs = replica_specs(config, runs, "ttft", "redis://r", ["http://e0"])
    assert [(s.label, s.assign, len(s.commands)) for s in specs] == [
        ("1 replica", "random", 1),
        ("2 replicas, random", "random", 2),
        ("2 replicas, round-robin", "round_robin", 2),
        ("2 replicas, mirrors only", "random", 2),
        ("2 replicas, private", "random", 2),
    ]
    assert "--no-read-your-writes" in specs[3].commands[0]
    assert "--state" not in specs[4].commands[0]
    args = build_parser().parse_args(
        ["serve", "--worker", "http://e0", "--state", "redis://r", "--no-read-your-writes"]
    )
    assert flag_overrides(args)["state"] == {"url": "redis://r", "read_your_writes": False}


async def test_round_robin_sends_each_request_to_the_next_replica() -> None:
    async with aiohttp.ClientSession() as http:
        client = ChatClient(http, "http://a", "m", ("http://b", "http://c"), assign="round_robin")
        hosts = [client._url().split("/")[2] for _ in range(6)]
        assert hosts == ["b", "c", "a", "b", "c", "a"]
        spread = ChatClient(http, "http://a", "m", ("http://b",), seed=3)
        assert {spread._url() for _ in range(50)} == {
            "http://a/v1/chat/completions",
            "http://b/v1/chat/completions",
        }


def test_a_matrix_row_can_be_replayed_through_the_replicas() -> None:
    args = build_parser().parse_args(["bench", "replicas", "--row", "chat"])
    assert args.row == "chat"
    with pytest.raises(SystemExit):  # not a row
        build_parser().parse_args(["bench", "replicas", "--row", "nonesuch"])
