"""Capacity math and the ``kvrouter capacity`` planner against published figures."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from router.cli import main
from router.planning.capacity import (
    GB,
    CapacityError,
    ModelShape,
    gpu,
    load_model,
    plan,
    preset_names,
)
from router.planning.interruption import interruption

ROOT = Path(__file__).resolve().parents[2]

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


# The interruption cost of a plan: what one worker's failure takes out (issue #16, section 3).
DENSE_8B = {**GQA_32L, "num_parameters": 8_000_000_000, "num_active_parameters": 8_000_000_000}


def test_tokens_at_risk_are_the_workers_capacity_and_the_checkpoint_holds_them() -> None:
    model = ModelShape.from_config(MLA_78L, "mla")
    worker = plan(model, gpu("b200"), 8, 0.9, kv_dtype_bytes=1, weight_bytes=753 * GB)
    cost = interruption(worker, model, gpu("b200"), 8, workers=4, context_tokens=1_000_000)
    assert cost.tokens_at_risk == worker.resident_tokens
    assert cost.fleet_tokens == 4 * worker.resident_tokens
    assert cost.share_of_fleet == 0.25
    assert cost.checkpoint_bytes == worker.resident_tokens * 44_928
    assert cost.checkpoint_bytes <= worker.kv_bytes
    assert interruption(worker, model, gpu("b200"), 8, 1, 1_000_000).fleet_rebuild_seconds is None


def test_rebuild_time_scales_with_mfu_and_model_size() -> None:
    """Half the MFU, twice the time. A model twice as deep has twice the parameters and
    twice the attention per token, so on the same GPU and the same tokens at risk it takes
    exactly twice as long."""
    model = ModelShape.from_config(DENSE_8B, "dense")
    h100 = gpu("h100")
    worker = plan(model, h100, 1, 0.9)
    base = interruption(worker, model, h100, 1, 4, 8192, mfu=0.5)
    assert interruption(worker, model, h100, 1, 4, 8192, mfu=0.25).rebuild_seconds == (
        pytest.approx(2 * base.rebuild_seconds)
    )
    double = dataclasses.replace(
        model, num_layers=2 * model.num_layers, active_parameters=2 * model.active_parameters
    )
    assert interruption(worker, double, h100, 1, 4, 8192).rebuild_seconds == pytest.approx(
        2 * base.rebuild_seconds
    )
    # Twice the GPUs per worker: twice the FLOP/s and twice the restore links.
    wide = interruption(worker, model, h100, 2, 4, 8192)
    assert wide.rebuild_seconds == pytest.approx(base.rebuild_seconds / 2)
    assert wide.restore_seconds == pytest.approx(base.restore_seconds / 2)


def test_interruption_by_hand_dense_8b_on_one_h100() -> None:
    """An 8B dense model (32 layers, 8 KV heads x 128, BF16) on one H100 at 0.9, 8,192-token
    sessions, four workers:

    * KV memory: 80 GB x 0.9 - 8e9 x 2 bytes = 72 - 16 = 56 GB; bytes per token
      2 x 8 x 128 x 2 x 32 = 131,072; at risk 56e9 // 131,072 = 427,246 tokens.
    * FLOPs per token: 2 x 8e9 + 2 x 32 layers x (32 x 128) x 8,192 = 16e9 + 2,147,483,648
      = 18,147,483,648.
    * rate: 989e12 x 0.5 / 18,147,483,648 = 27,249 tokens/s; rebuild on one worker
      427,246 / 27,249 = 15.68 s, across 3 survivors 5.23 s.
    * checkpoint: 427,246 x 131,072 = 55,999,987,712 bytes; at 50 GB/s, 1.12 s.
    """
    model = ModelShape.from_config(DENSE_8B, "dense")
    cost = interruption(plan(model, gpu("h100"), 1, 0.9), model, gpu("h100"), 1, 4, 8192)
    assert cost.tokens_at_risk == 427_246
    assert round(cost.prefill_tokens_per_s) == 27_249
    assert round(cost.rebuild_seconds, 2) == 15.68
    assert cost.fleet_rebuild_seconds is not None
    assert round(cost.fleet_rebuild_seconds, 2) == 5.23
    assert cost.checkpoint_bytes == 55_999_987_712
    assert round(cost.restore_seconds, 2) == 1.12
    assert round(cost.weights_reload_seconds, 2) == 0.32


def test_interruption_refuses_what_it_cannot_use() -> None:
    model = ModelShape.from_config(DENSE_8B, "dense")
    h100 = gpu("h100")
    worker = plan(model, h100)
    with pytest.raises(CapacityError, match="workers"):
        interruption(worker, model, h100, 1, 0, 8192)
    with pytest.raises(CapacityError, match="MFU"):
        interruption(worker, model, h100, 1, 4, 8192, mfu=1.5)
    with pytest.raises(CapacityError, match="restore"):
        interruption(worker, model, h100, 1, 4, 8192, restore_gbps=0)


def test_planner_prints_the_worked_examples_failure_cost(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """docs/capacity-planning.md's two worked examples, run as printed there (configs in
    docs/capacity/)."""
    gqa = ROOT / "docs" / "capacity" / "gqa-32l.json"
    assert json.loads(gqa.read_text()) == GQA_32L
    args = ["--gpu", "h200", "--gpus", "1", "--workers", "8", "--context", "100000"]
    assert main(["capacity", "--model-config", str(gqa), *args, "--sessions", "64"]) == 0
    out = capsys.readouterr().out
    assert "If a worker fails (1 of 8, each 1 x H200" in out
    assert re.search(r"tokens at risk\s+845,386 \(12\.5% of the fleet's 6,763,088\)", out)
    assert re.search(r"on one worker\s+72\.3 s", out)
    assert re.search(r"across 7 survivors\s+10\.3 s", out)
    assert re.search(r"checkpoint\s+110,806,433,792 bytes", out)

    glm = ROOT / "docs" / "capacity" / "glm-5.2.json"
    assert {k: v for k, v in json.loads(glm.read_text()).items() if k in MLA_78L} == MLA_78L
    args = ["--gpu", "b200", "--gpus", "8", "--workers", "4", "--kv-dtype", "fp8"]
    args += ["--weights-gb", "753", "--context", "1000000"]
    assert main(["capacity", "--model-config", str(glm), *args]) == 0
    out = capsys.readouterr().out
    assert re.search(r"sessions of 1,000,000 tokens\s+15\s+12", out)
    assert re.search(r"tokens at risk\s+12,086,004 \(25\.0%", out)
    assert re.search(r"on one worker\s+7,830 s \(2\.2 h\)", out)
    assert re.search(r"restore\s+1\.4 s at 50 GB/s x 8 GPUs", out)

    assert main(["capacity", "--model-config", str(gqa), "--workers", "0"]) == 2
    assert "workers must be >= 1" in capsys.readouterr().out
