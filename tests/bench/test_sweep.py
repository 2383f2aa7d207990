"""The sweep's knob values: numbers, or true and false for a switch."""

from __future__ import annotations

import argparse

import pytest

from bench.compare.sweep import label_for, parse_knob


def test_a_switch_sweeps_true_and_false_and_numbers_stay_numbers() -> None:
    assert parse_knob("spread_first_turns=false,TRUE") == ("spread_first_turns", [False, True])
    assert parse_knob("cache_weight=0,0.5,2") == ("cache_weight", [0.0, 0.5, 2.0])
    assert label_for("spread_first_turns", False) == "spread_first_turns=false"
    assert label_for("cache_weight", 0.5) == "cache_weight=0.5"
    for bad in ("cache_weight", "cache_weight=", "cache_weight=yes"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_knob(bad)
