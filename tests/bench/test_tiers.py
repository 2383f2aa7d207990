"""``kvrouter bench tiers``: its figures from the engines' records, and its routers."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.compare import tiers
from bench.compare.demo import demo_config


def test_the_engines_records_split_the_hits_by_tier() -> None:
    records: list[dict[str, Any]] = [
        {
            "prompt_tokens": 100,
            "cached_at_schedule": 80,
            "loaded": 30,
            "arrived": 1.0,
            "first_token": 3.0,
        },
        {
            "prompt_tokens": 100,
            "cached_at_schedule": 50,
            "loaded": 0,
            "arrived": 2.0,
            "first_token": 2.5,
        },
        {"prompt_tokens": 100, "cached_at_schedule": None, "loaded": 0, "arrived": 4.0},  # waiting
    ]
    figures = tiers.tier_figures(records)
    assert figures["gpu_hit_share"] == pytest.approx(100 / 200)
    assert figures["cpu_hit_share"] == pytest.approx(30 / 200)
    assert figures["reloaded_turns"] == 1
    assert figures["reloaded_ttft_p50"] == figures["reloaded_ttft_p99"] == pytest.approx(2.0)


def test_the_routers_differ_in_their_tier_knobs_alone(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    tiers.register(parser.add_subparsers())
    config = demo_config(parser.parse_args(["tiers"]))
    urls = ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
    specs = tiers.router_specs(config, urls, Path("/m"), 5700, tmp_path, None)
    assert [s.label for s in specs] == ["tier-aware", "tier-sticky", "tier-blind"]
    knobs = [
        [a for a in s.commands[0] if a.startswith(("count_offloaded=", "spread_reloads="))]
        for s in specs
    ]
    assert knobs == [
        ["count_offloaded=true", "spread_reloads=true"],
        ["count_offloaded=true", "spread_reloads=false"],
        ["count_offloaded=false"],
    ]
    written = yaml.safe_load((tmp_path / "tiers.yaml").read_text())
    assert [w["kv_events"]["endpoint"] for w in written["workers"]] == [
        "tcp://127.0.0.1:5700",
        "tcp://127.0.0.1:5702",
    ]
    assert written["capacity"]["model"] == "llama-3.1-8b"  # what a reload's bytes come from
