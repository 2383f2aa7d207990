"""Capacity of hybrid-attention models: sliding windows, recurrent states, indexers and
compressed caches, by hand against ``kvrouter capacity``'s model of them."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from router.cli import main
from router.planning.capacity import GB, CapacityError, ModelShape, gpu, load_model, plan
from router.planning.interruption import interruption

# 8 layers, 2 of them full attention; a layer keeps 2 (K, V) x 2 heads x 64 x 2 bytes =
# 512 bytes a token.
TWO_FULL_SIX_SLIDING: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 2,
    "torch_dtype": "bfloat16",
}
# 4 layers, every 4th full attention: 1 full layer (512 bytes a token, as above) and 3 gated
# delta nets with 2 key heads x 32 and 4 value heads x 16, a 4-wide convolution.
ONE_FULL_THREE_LINEAR: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "full_attention_interval": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 32,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "torch_dtype": "bfloat16",
}


def _preset(name: str) -> dict[str, Any]:
    path = resources.files("router.planning") / "model_presets" / f"{name}.json"
    config: dict[str, Any] = json.loads(path.read_text())
    return config


def test_sliding_window_layers_stop_growing_at_their_window() -> None:
    """bytes(C) = 2 full layers x 512 x C + 6 sliding layers x 512 x min(C, 512)."""
    model = ModelShape.from_config(TWO_FULL_SIX_SLIDING, "tiny")
    assert model.is_hybrid
    assert model.kv_bytes_per_token() == 1_024
    fleet = plan(model, gpu("h100"), weight_bytes=80 * GB - 1_000_000_000)
    assert fleet.kv_bytes == 1_000_000_000
    assert fleet.session_bytes(100) == 102_400 + 307_200
    assert fleet.session_bytes(512) == 524_288 + 1_572_864
    assert fleet.session_bytes(10_000) == 10_240_000 + 1_572_864
    assert fleet.overhead_bytes(10_000) == (1_572_864, 0)
    # 1e9 // 11,812,864 sessions; 1e9 x 10,000 // 11,812,864 tokens; 1e9 // 1,024 as C grows
    assert fleet.sessions_that_fit(10_000) == 84
    assert fleet.resident_tokens_at(10_000) == 846_534
    assert fleet.resident_tokens == 976_562
    at_fp8 = plan(model, gpu("h100"), kv_dtype_bytes=1, weight_bytes=0)
    assert at_fp8.session_bytes(10_000) == (10_240_000 + 1_572_864) // 2


def test_linear_attention_layers_keep_a_fixed_state() -> None:
    """Per gated delta net: convolution (4 - 1) x (2 x 2 x 32 + 4 x 16) = 576 values and
    recurrent state 4 x 32 x 16 = 2,048 values, both BF16: 5,248 bytes; 3 of them 15,744.
    With an FP32 recurrent state (``mamba_ssm_dtype``): 1,152 + 8,192 = 9,344 each."""
    model = ModelShape.from_config(ONE_FULL_THREE_LINEAR, "tiny-linear")
    assert model.kv_bytes_per_token() == 512
    fleet = plan(model, gpu("h100"), weight_bytes=0)
    assert fleet.overhead_bytes(1_000) == (0, 15_744)
    assert fleet.session_bytes(1_000) == 512_000 + 15_744
    assert fleet.session_bytes(1) == 512 + 15_744
    fp32 = ModelShape.from_config({**ONE_FULL_THREE_LINEAR, "mamba_ssm_dtype": "float32"}, "f")
    assert fp32.kv_layout.fixed_bytes == 3 * 9_344
    # --kv-dtype changes the attention cache, not the recurrent state
    assert plan(model, gpu("h100"), kv_dtype_bytes=1).session_bytes(1_000) == 256_000 + 15_744


def test_a_model_without_windows_or_states_is_not_hybrid() -> None:
    plain = {k: v for k, v in TWO_FULL_SIX_SLIDING.items() if k != "layer_types"}
    model = ModelShape.from_config(plain, "plain")
    assert not model.is_hybrid
    assert model.kv_bytes_per_token() == 8 * 512
    fleet = plan(model, gpu("h100"), weight_bytes=0)
    assert fleet.resident_tokens_at(12_345) == fleet.resident_tokens == 80 * GB // 4_096


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**TWO_FULL_SIX_SLIDING, "layer_types": ["chunked_attention"] * 8}, "sliding_attention"),
        ({**TWO_FULL_SIX_SLIDING, "layer_types": ["full_attention"] * 3}, "3 layers"),
        ({**ONE_FULL_THREE_LINEAR, "linear_num_value_heads": None}, "linear_num_value_heads"),
        ({**TWO_FULL_SIX_SLIDING, "layer_types": ["sliding_attention"] * 8}, "unbounded"),
    ],
)
def test_layer_kinds_it_cannot_read_are_errors(config: dict[str, Any], message: str) -> None:
    with pytest.raises(CapacityError, match=message):
        ModelShape.from_config(config, "bad")


def _full_layers(config: dict[str, Any]) -> int:
    layers = int(config["num_hidden_layers"])
    if "layer_types" in config:
        return list(config["layer_types"]).count("full_attention")
    every = config.get("sliding_window_pattern") or config["full_attention_interval"]
    return sum((i + 1) % int(every) == 0 for i in range(layers))


@pytest.mark.parametrize("name", ["gemma-3-27b", "gpt-oss-120b", "qwen3-next-80b-a3b"])
def test_gqa_hybrid_presets_grow_by_their_full_layers_alone(name: str) -> None:
    """Gemma 3 27B: 10 of 62 layers full, 2 x 16 x 128 x 2 bytes each: 81,920 bytes a token.
    GPT-OSS 120B: 18 of 36, 2 x 8 x 64 x 2: 36,864. Qwen3-Next 80B: 12 of 48, 2 x 2 x 256 x 2:
    24,576."""
    config = _preset(name)
    per_layer = 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    expected = {"gemma-3-27b": 81_920, "gpt-oss-120b": 36_864, "qwen3-next-80b-a3b": 24_576}
    assert _full_layers(config) * per_layer == expected[name]
    model = load_model(name)
    assert model.is_hybrid
    assert model.kv_bytes_per_token() == expected[name]


def test_the_windowed_and_recurrent_presets_overheads_by_hand() -> None:
    """Gemma 3: 52 sliding layers x 1,024 tokens x 8,192 bytes. GPT-OSS: 18 x 128 x 2,048.
    Qwen3-Next: 36 gated delta nets x (3 x (2 x 16 x 128 + 32 x 128) x 2 bytes + 32 x 128 x
    128 x 2 bytes) = 36 x (49,152 + 1,048,576)."""
    b200 = gpu("b200")
    assert plan(load_model("gemma-3-27b"), b200).overhead_bytes(100_000) == (436_207_616, 0)
    assert plan(load_model("gemma-3-27b"), b200).overhead_bytes(1_000) == (52 * 1_000 * 8_192, 0)
    assert plan(load_model("gpt-oss-120b"), b200).overhead_bytes(100_000) == (4_718_592, 0)
    assert plan(load_model("qwen3-next-80b-a3b"), b200).overhead_bytes(100_000) == (
        0,
        39_518_208,
    )


@pytest.mark.parametrize(("name", "layers"), [("deepseek-v3.2", 61), ("glm-5-fp8", 78)])
def test_sparse_attention_indexers_add_their_keys_to_every_token(name: str, layers: int) -> None:
    """MLA's 512 + 64 values a layer, plus the indexer's key: 128 FP8 values and one FP32
    scale per 128 = 132 bytes a layer, whatever the KV dtype."""
    config = _preset(name)
    mla = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    key = config["index_head_dim"] + config["index_head_dim"] // 128 * 4
    assert (mla, key, config["num_hidden_layers"]) == (576, 132, layers)
    model = load_model(name)
    assert not model.is_hybrid  # every group keeps every token
    assert model.kv_bytes_per_token() == layers * (576 * 2 + 132)
    assert model.kv_bytes_per_token(1) == layers * (576 + 132)


def test_deepseek_v4_pro_compressed_caches_by_hand() -> None:
    """61 layers, each a 128-token window of 512-wide latents; 30 layers of ratio 4 (one
    entry per 4 tokens, and an indexer key of 132 bytes per entry), 31 of ratio 128.

    * bytes a token, BF16: 30 x 1,024 / 4 + 31 x 1,024 / 128 + 30 x 132 / 4 = 7,680 + 248 +
      990 = 8,918; FP8: 3,840 + 124 + 990 = 4,954.
    * windows: 61 x 128 x 1,024 = 7,995,392 bytes.
    * compressor states, FP32: ratio 4, overlapping: 8 rows x (2 x 2 x 512) x 4 = 65,536 and
      the indexer's 8 x (2 x 2 x 128) x 4 = 16,384; ratio 128: 128 x (2 x 512) x 4 = 524,288.
      30 x 81,920 + 31 x 524,288 = 18,710,528.
    * a 100,000-token session: 30 x 25,000 x 1,024 + 31 x 781 x 1,024 + 30 x 25,000 x 132 =
      768,000,000 + 24,792,064 + 99,000,000, plus the two above: 918,497,984.
    * 8 x B200 at 0.9 with the checkpoint's 865 GB of weights: 431 GB, 469 sessions,
      431e9 x 100,000 // 918,497,984 = 46,924,436 tokens; 431e9 // 8,918 = 48,329,221.
    """
    config = _preset("deepseek-v4-pro")
    ratios = config["compress_ratios"][: config["num_hidden_layers"]]
    assert (ratios.count(4), ratios.count(128), config["sliding_window"]) == (30, 31, 128)
    model = load_model("deepseek-v4-pro")
    assert model.kv_bytes_per_token() == 8_918
    assert model.kv_bytes_per_token(1) == 4_954
    node = plan(model, gpu("b200"), 8, 0.9, weight_bytes=865 * GB)
    assert node.overhead_bytes(100_000) == (7_995_392, 18_710_528)
    assert node.session_bytes(100_000) == 918_497_984
    assert node.kv_bytes == 431 * GB
    assert node.sessions_that_fit(100_000) == 469
    assert node.resident_tokens_at(100_000) == 46_924_436
    assert node.resident_tokens == 48_329_221


def test_a_multimodal_config_is_read_through_its_text_config() -> None:
    """Gemma 3's own config.json nests the text model and leaves the 5:1 pattern to
    transformers' default for ``gemma3_text``."""
    flat = _preset("gemma-3-27b")
    text = {k: v for k, v in flat.items() if k not in ("sliding_window_pattern", "torch_dtype")}
    nested = {"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": text}
    model = ModelShape.from_config(nested, "gemma-3-27b-it")
    assert model.kv_layout == load_model("gemma-3-27b").kv_layout
    assert model.num_layers == 62


def test_hybrid_interruption_risks_the_tokens_that_fit_at_the_context() -> None:
    model = ModelShape.from_config(TWO_FULL_SIX_SLIDING, "tiny")
    worker = plan(model, gpu("h100"), weight_bytes=80 * GB - 1_000_000_000)
    cost = interruption(worker, model, gpu("h100"), 1, 2, 10_000)
    assert cost.tokens_at_risk == 846_534
    assert cost.checkpoint_bytes == 846_534 * 11_812_864 // 10_000
    assert cost.checkpoint_bytes <= worker.kv_bytes


def test_planner_prints_the_layer_kinds_and_the_overheads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Gemma 3 27B on 8 x B200 with 54 GB of weights: 1,386 GB of KV at all of HBM, 1,242 GB
    at 0.9; a 100,000-token session 8,192,000,000 + 436,207,616 bytes."""
    args = ["--gpu", "b200", "--gpus", "8", "--weights-gb", "54", "--context", "100000"]
    assert main(["capacity", "--model-config", "gemma-3-27b", *args]) == 0
    out = capsys.readouterr().out
    assert (
        "(hybrid: 10 full-attention GQA layers + 52 sliding-window (window 1,024) layers; "
        "16 KV heads x 128)"
    ) in out
    assert "bytes per token  81,920 as a session grows" in out
    assert "+ 436,207,616 bytes in windows + 0 bytes of fixed state" in out
    at_context = [1_386 * GB * 100_000 // 8_628_207_616, 1_242 * GB * 100_000 // 8_628_207_616]
    row = f"{'resident tokens at 100,000':28}{at_context[0]:>16,}{at_context[1]:>16,}"
    assert row in out
    assert f"{'resident tokens, C -> inf':28}{1_386 * GB // 81_920:>16,}" in out
    assert f"tokens at risk              {at_context[1]:,} (100.0%" in out


LLAMA_8B_ON_H100 = """\
model            llama-3.1-8b (GQA, 32 layers, 8 KV heads x 128), KV dtype 2 bytes
bytes per token  131,072
weights          16.1 GB
GPU memory       1 x H100 (80.0 GB) = 80.0 GB
one session      8,192 tokens = 1.1 GB

                                  all of HBM         at 0.90
KV memory after weights              63.9 GB         55.9 GB
resident tokens                      487,823         426,788
sessions of 8,192 tokens                  59              52

If a worker fails (1 of 4, each 1 x H100, its cache full at 0.90)
tokens at risk              426,788 (25.0% of the fleet's 1,707,152)
"""


def test_a_model_without_hybrid_layers_prints_what_it_printed_before(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The output before hybrid layers existed, to the character."""
    args = ["--model-config", "llama-3.1-8b", "--gpu", "h100", "--workers", "4"]
    assert main(["capacity", *args, "--context", "8192"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(LLAMA_8B_ON_H100)
    assert "checkpoint                55,939,956,736 bytes (55.9 GB)" in out
    assert "in windows" not in out and "C -> inf" not in out


def test_the_documented_hybrid_example_is_what_the_planner_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "capacity-planning.md").read_text()
    block = doc.split("$ kvrouter capacity --model-config gemma-3-27b", 1)[1].split("```", 1)[0]
    command, *printed = block.splitlines()
    assert main(["capacity", "--model-config", "gemma-3-27b", *command.split()]) == 0
    assert capsys.readouterr().out.splitlines()[: len(printed)] == printed
