"""Capacity math and the ``kvrouter capacity`` planner against published figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from router.capacity import GB, CapacityError, ModelShape, gpu, load_model, plan, preset_names
from router.cli import main

GQA_32L = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
}
MLA_78L = {
    "hidden_size": 6144,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "torch_dtype": "bfloat16",
}


def test_gqa_bytes_per_token_and_sessions() -> None:
    model = ModelShape.from_config(GQA_32L, "gqa")
    assert model.kv_bytes_per_token() == 131_072
    session = 100_000 * model.kv_bytes_per_token()
    assert round(session / GB, 1) == 13.1
    assert round(64 * session / GB) == 839


def test_mla_bytes_per_token_at_fp8() -> None:
    model = ModelShape.from_config(MLA_78L, "mla")
    assert model.attention == "mla"
    assert model.kv_bytes_per_token(1) == 44_928


def test_mla_million_token_sessions_on_eight_b200() -> None:
    model = ModelShape.from_config(MLA_78L, "mla")
    fleet = plan(model, gpu("b200"), num_gpus=8, kv_dtype_bytes=1, weight_bytes=753 * GB)
    assert fleet.kv_bytes == 687 * GB
    assert fleet.sessions_that_fit(1_000_000) == 15


def test_presets_count_their_parameters() -> None:
    assert set(preset_names()) >= {"llama-3.1-8b", "llama-3.1-70b", "deepseek-v3"}
    assert round(load_model("llama-3.1-8b").num_parameters / 1e9, 1) == 8.0
    assert round(load_model("llama-3.1-70b").num_parameters / 1e9) == 71
    deepseek = load_model("deepseek-v3")
    assert round(deepseek.num_parameters / 1e9) == 671
    assert round(deepseek.active_parameters / 1e9) == 38
    assert deepseek.weights_dtype_bytes == 1  # FP8 weights
    assert deepseek.kv_bytes_per_token() == 61 * 576 * 2


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(CapacityError, match=r"llama-3\.1-8b"):
        load_model("gpt-9")
    with pytest.raises(CapacityError, match="h100"):
        gpu("tpu")


def test_planner_prints_the_published_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(GQA_32L))
    assert (
        main(
            [
                "capacity",
                "--model-config",
                str(config),
                "--gpu",
                "h200",
                "--gpus",
                "8",
                "--context",
                "100000",
                "--sessions",
                "64",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert re.search(r"bytes per token\s+131,072", out)
    assert "100,000 tokens = 13.1 GB" in out
    assert re.search(r"64 sessions\s+838\.9 GB", out)

    config.write_text(json.dumps(MLA_78L))
    assert (
        main(
            [
                "capacity",
                "--model-config",
                str(config),
                "--gpu",
                "b200",
                "--gpus",
                "8",
                "--kv-dtype",
                "fp8",
                "--weights-gb",
                "753",
                "--context",
                "1000000",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert re.search(r"bytes per token\s+44,928", out)
    assert re.search(r"sessions of 1,000,000 tokens\s+15\s", out)
