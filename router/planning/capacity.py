"""KV-cache capacity math: bytes per token, weights, and resident tokens per GPU.

Memory is the budget. An engine keeps ``(GPU memory x utilization - weights) /
bytes_per_token`` tokens of KV cache, where

* grouped-query attention stores K and V per KV head:
  ``2 x num_kv_heads x head_dim x dtype_bytes x layers``;
* multi-head latent attention (DeepSeek, GLM) stores one compressed latent plus the
  decoupled RoPE key: ``(kv_lora_rank + qk_rope_head_dim) x dtype_bytes x layers``.

GPU memory sizes are the published ones in decimal gigabytes (1 GB = 1e9 bytes), the unit
in which published capacity figures are quoted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

GB = 1_000_000_000

DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "auto": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "int4": 0.5,
    "fp4": 0.5,
}

Attention = Literal["gqa", "mla"]


class CapacityError(ValueError):
    """A model shape, GPU or dtype the capacity math cannot use."""


def dtype_bytes(name: str) -> float:
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise CapacityError(f"unknown dtype {name!r}; known: {known}") from None


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    memory_bytes: int
    dense_bf16_flops: float  # peak dense BF16 FLOP/s
    hbm_bandwidth: float  # bytes/s


GPUS: dict[str, GpuSpec] = {
    "a100": GpuSpec("A100", 80 * GB, 312e12, 2.039e12),
    "h100": GpuSpec("H100", 80 * GB, 989e12, 3.35e12),
    "h200": GpuSpec("H200", 141 * GB, 989e12, 4.8e12),
    "b200": GpuSpec("B200", 180 * GB, 2250e12, 8.0e12),
}


def gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise CapacityError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    attention: Attention
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    hidden_size: int
    dtype_bytes: float  # of the KV cache unless overridden
    weights_dtype_bytes: float
    num_parameters: int
    active_parameters: int
    max_position_embeddings: int

    def kv_bytes_per_token(self, kv_dtype_bytes: float | None = None) -> int:
        per_value = self.dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
        if self.attention == "mla":
            width = self.kv_lora_rank + self.qk_rope_head_dim
        else:
            width = 2 * self.num_kv_heads * self.head_dim
        return int(width * per_value * self.num_layers)

    @property
    def weight_bytes(self) -> int:
        return int(self.num_parameters * self.weights_dtype_bytes)

    @property
    def attention_width(self) -> int:
        """Query width that attends over the context (for attention FLOPs)."""
        if self.attention == "mla":
            return self.num_attention_heads * (self.kv_lora_rank + self.qk_rope_head_dim)
        return self.num_attention_heads * self.head_dim

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str) -> ModelShape:
        """Read a Hugging Face ``config.json``-style mapping.

        Parameter counts come from ``num_parameters`` / ``num_active_parameters`` when
        present, else are counted from the shape (dense and DeepSeek-style MoE layers).
        """
        try:
            hidden = int(config["hidden_size"])
            layers = int(config["num_hidden_layers"])
            heads = int(config["num_attention_heads"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CapacityError(
                f"{name}: config needs hidden_size, num_hidden_layers, num_attention_heads ({exc})"
            ) from exc
        kv_heads = int(config.get("num_key_value_heads", heads))
        head_dim = int(config.get("head_dim") or hidden // heads)
        mla = "kv_lora_rank" in config and config.get("kv_lora_rank") is not None
        torch_dtype = str(config.get("torch_dtype", "bfloat16"))
        quant = config.get("quantization_config") or {}
        weights_dtype = str(quant.get("quant_method", torch_dtype)) if quant else torch_dtype
        total, active = _count_parameters(config, hidden, layers, heads, kv_heads, head_dim, mla)
        return cls(
            name=name,
            attention="mla" if mla else "gqa",
            num_layers=layers,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            kv_lora_rank=int(config.get("kv_lora_rank") or 0),
            qk_rope_head_dim=int(config.get("qk_rope_head_dim") or 0),
            hidden_size=hidden,
            dtype_bytes=dtype_bytes(torch_dtype),
            weights_dtype_bytes=dtype_bytes(weights_dtype),
            num_parameters=int(config.get("num_parameters") or total),
            active_parameters=int(config.get("num_active_parameters") or active),
            max_position_embeddings=int(config.get("max_position_embeddings", 131072)),
        )


def _count_parameters(
    config: Mapping[str, Any],
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    mla: bool,
) -> tuple[int, int]:
    vocab = int(config.get("vocab_size", 32000))
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    if mla:
        rope = int(config.get("qk_rope_head_dim", 64))
        nope = int(config.get("qk_nope_head_dim", 128))
        v_dim = int(config.get("v_head_dim", 128))
        kv_rank = int(config["kv_lora_rank"])
        q_rank = int(config.get("q_lora_rank") or 0)
        q_proj = (
            (hidden * q_rank + q_rank * heads * (nope + rope))
            if q_rank
            else (hidden * heads * (nope + rope))
        )
        attention = (
            q_proj
            + hidden * (kv_rank + rope)
            + kv_rank * heads * (nope + v_dim)
            + heads * v_dim * hidden
        )
    else:
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    dense_mlp = 3 * hidden * int(config.get("intermediate_size", 4 * hidden))
    experts = int(config.get("n_routed_experts") or config.get("num_local_experts") or 0)
    if not experts:
        per_layer = attention + dense_mlp
        return embeddings + layers * per_layer, embeddings + layers * per_layer
    expert_mlp = (
        3
        * hidden
        * int(config.get("moe_intermediate_size") or config.get("intermediate_size", 4 * hidden))
    )
    shared = int(config.get("n_shared_experts") or 0)
    top_k = int(config.get("num_experts_per_tok", 2))
    dense_layers = int(config.get("first_k_dense_replace") or 0)
    moe_layers = layers - dense_layers
    router_weights = hidden * experts
    total = (
        embeddings
        + layers * attention
        + dense_layers * dense_mlp
        + moe_layers * ((experts + shared) * expert_mlp + router_weights)
    )
    active = (
        embeddings
        + layers * attention
        + dense_layers * dense_mlp
        + moe_layers * ((top_k + shared) * expert_mlp + router_weights)
    )
    return total, active


def preset_names() -> list[str]:
    folder = resources.files("router.planning") / "model_presets"
    return sorted(
        p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")
    )


def load_model(name_or_path: str) -> ModelShape:
    """A preset by name (see ``preset_names()``) or a ``config.json`` path."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CapacityError(f"cannot read model config {path}: {exc}") from exc
        return ModelShape.from_config(config, path.stem)
    resource = resources.files("router.planning") / "model_presets" / f"{name_or_path}.json"
    if not resource.is_file():
        raise CapacityError(
            f"unknown model {name_or_path!r}; presets: {', '.join(preset_names())}"
            " (or give a config.json path)"
        )
    return ModelShape.from_config(json.loads(resource.read_text()), name_or_path)


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    bytes_per_token: int
    weight_bytes: int
    total_memory_bytes: int
    utilization: float

    @property
    def kv_bytes(self) -> int:
        return max(0, int(self.total_memory_bytes * self.utilization) - self.weight_bytes)

    @property
    def resident_tokens(self) -> int:
        return self.kv_bytes // self.bytes_per_token

    def session_bytes(self, context_tokens: int) -> int:
        return context_tokens * self.bytes_per_token

    def sessions_that_fit(self, context_tokens: int) -> int:
        return self.resident_tokens // context_tokens if context_tokens > 0 else 0


def plan(
    model: ModelShape,
    gpu_spec: GpuSpec,
    num_gpus: int = 1,
    utilization: float = 1.0,
    kv_dtype_bytes: float | None = None,
    weight_bytes: int | None = None,
) -> CapacityPlan:
    if num_gpus < 1:
        raise CapacityError("num_gpus must be >= 1")
    if not 0 < utilization <= 1:
        raise CapacityError("utilization must be in (0, 1]")
    return CapacityPlan(
        bytes_per_token=model.kv_bytes_per_token(kv_dtype_bytes),
        weight_bytes=model.weight_bytes if weight_bytes is None else weight_bytes,
        total_memory_bytes=gpu_spec.memory_bytes * num_gpus,
        utilization=utilization,
    )
