"""KV-cache capacity math: bytes per token, weights, and resident tokens per GPU.

Memory is the budget. An engine keeps ``(GPU memory x utilization - weights) /
bytes_per_token`` tokens of KV cache, where

* grouped-query attention stores K and V per KV head:
  ``2 x num_kv_heads x head_dim x dtype_bytes x layers``;
* multi-head latent attention (DeepSeek, GLM) stores one compressed latent plus the
  decoupled RoPE key: ``(kv_lora_rank + qk_rope_head_dim) x dtype_bytes x layers``.

A hybrid model's layers differ (``kv_layout``, read by ``layer_kinds``): sliding-window
layers stop growing at their window, linear-attention layers keep a fixed state, indexers
and compressed caches add their own bytes per token. Its ``bytes_per_token`` is what keeps
growing with the context, and a C-token session costs ``bytes(C)``, not ``C x
bytes_per_token``, so its capacity is stated at a session length (``resident_tokens_at``).

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

from router.planning.kv_layout import KvLayout, LayerGroup
from router.planning.layer_kinds import LayerKindError, read_layout

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
    "mxfp4": 4.25 / 8,  # 4-bit values and one 8-bit scale per 32 of them
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
    kv_layout: KvLayout
    expert_parameters: int  # of the routed experts, counted in num_parameters
    expert_weights_dtype_bytes: float

    def kv_bytes_per_token(self, kv_dtype_bytes: float | None = None) -> int:
        """What each further token of context costs: every layer for a model that keeps the
        whole context in all of them, the full-attention (and indexer, compressed) layers of a
        hybrid one, whose windows and states do not grow (``kv_layout.session_bytes``)."""
        per_value = self.dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
        return self.kv_layout.bytes_per_token(per_value)

    @property
    def is_hybrid(self) -> bool:
        return self.kv_layout.is_hybrid

    @property
    def weight_bytes(self) -> int:
        dense = self.num_parameters - self.expert_parameters
        experts = self.expert_parameters * self.expert_weights_dtype_bytes
        return int(dense * self.weights_dtype_bytes + experts)

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
        present, else are counted from the shape (dense and DeepSeek-style MoE layers). A
        multimodal config's ``text_config`` is the model read.
        """
        text = config.get("text_config")
        if isinstance(text, Mapping):
            config = {**config, **text}
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
        torch_dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        weights_dtype, experts_dtype = _weight_dtypes(config, torch_dtype)
        total, active, experts = _count_parameters(
            config, hidden, layers, heads, kv_heads, head_dim, mla
        )
        num_parameters = int(config.get("num_parameters") or total)
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
            num_parameters=num_parameters,
            active_parameters=int(config.get("num_active_parameters") or active),
            max_position_embeddings=int(config.get("max_position_embeddings", 131072)),
            kv_layout=_kv_layout(config, name, layers, mla, 2 * kv_heads * head_dim, torch_dtype),
            expert_parameters=min(experts, num_parameters),
            expert_weights_dtype_bytes=dtype_bytes(experts_dtype),
        )


def _kv_layout(
    config: Mapping[str, Any],
    name: str,
    layers: int,
    mla: bool,
    gqa_width: int,
    torch_dtype: str,
) -> KvLayout:
    if mla:
        width = int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim") or 0)
        full = LayerGroup("full", 1, width, label="MLA")
    else:
        full = LayerGroup("full", 1, gqa_width, label="GQA")
    ssm_dtype = config.get("mamba_ssm_dtype")
    state = dtype_bytes(torch_dtype), dtype_bytes(str(ssm_dtype or torch_dtype))
    try:
        layout = read_layout(config, layers, full, state)
    except LayerKindError as exc:
        raise CapacityError(f"{name}: {exc}") from exc
    if layout.bytes_per_token(1) == 0:
        raise CapacityError(f"{name}: no layer keeps the whole context; tokens are unbounded")
    return layout


def _weight_dtypes(config: Mapping[str, Any], torch_dtype: str) -> tuple[str, str]:
    """The dense weights' dtype and the routed experts': ``quantization_config``'s method
    for both, except that MXFP4 (GPT-OSS) quantizes the experts alone and ``expert_dtype``
    (DeepSeek-V4) sets theirs."""
    quant = config.get("quantization_config") or {}
    method = str(quant.get("quant_method", torch_dtype)) if quant else torch_dtype
    if method == "mxfp4":
        return torch_dtype, method
    return method, str(config.get("expert_dtype") or method)


def _count_parameters(
    config: Mapping[str, Any],
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    mla: bool,
) -> tuple[int, int, int]:
    """Total, active and routed-expert parameters."""
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
    experts = int(
        config.get("n_routed_experts")
        or config.get("num_local_experts")
        or config.get("num_experts")
        or 0
    )
    if not experts:
        per_layer = attention + dense_mlp
        return embeddings + layers * per_layer, embeddings + layers * per_layer, 0
    expert_mlp = (
        3
        * hidden
        * int(config.get("moe_intermediate_size") or config.get("intermediate_size", 4 * hidden))
    )
    shared_size = config.get("shared_expert_intermediate_size")
    shared_mlp = (
        3 * hidden * int(shared_size)
        if shared_size
        else int(config.get("n_shared_experts") or 0) * expert_mlp
    )
    top_k = int(config.get("num_experts_per_tok", 2))
    dense_layers = int(config.get("first_k_dense_replace") or 0)
    moe_layers = layers - dense_layers
    router_weights = hidden * experts
    common = (
        embeddings
        + layers * attention
        + dense_layers * dense_mlp
        + moe_layers * (shared_mlp + router_weights)
    )
    routed = moe_layers * experts * expert_mlp
    return common + routed, common + moe_layers * top_k * expert_mlp, routed


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
    """A KV budget, ``kv_bytes``, and what a sequence costs in it.

    ``resident_tokens`` is ``kv_bytes // bytes_per_token``: the tokens that fit when every
    layer keeps the whole context; for a hybrid model, the bound its capacity approaches as
    sessions grow long and their windows and states become negligible.
    ``resident_tokens_at(C)`` is the cache filled with C-token sessions, the last one in
    part: ``kv_bytes x C // session_bytes(C)``, within one session of
    ``sessions_that_fit(C) x C``, and ``resident_tokens`` for a model without windows or
    states.
    """

    kv_layout: KvLayout
    kv_dtype_bytes: float
    weight_bytes: int
    total_memory_bytes: int
    utilization: float

    @property
    def bytes_per_token(self) -> int:
        return self.kv_layout.bytes_per_token(self.kv_dtype_bytes)

    @property
    def kv_bytes(self) -> int:
        return max(0, int(self.total_memory_bytes * self.utilization) - self.weight_bytes)

    @property
    def resident_tokens(self) -> int:
        return self.kv_bytes // self.bytes_per_token

    def session_bytes(self, context_tokens: int) -> int:
        return self.kv_layout.session_bytes(context_tokens, self.kv_dtype_bytes)

    def overhead_bytes(self, context_tokens: int) -> tuple[int, int]:
        """A session's windowed bytes and its fixed state, beyond its growing bytes."""
        return (
            self.kv_layout.windowed_bytes(context_tokens, self.kv_dtype_bytes),
            self.kv_layout.fixed_bytes,
        )

    def sessions_that_fit(self, context_tokens: int) -> int:
        return self.kv_bytes // self.session_bytes(context_tokens) if context_tokens > 0 else 0

    def resident_tokens_at(self, context_tokens: int) -> int:
        if context_tokens <= 0:
            return 0
        return self.kv_bytes * context_tokens // self.session_bytes(context_tokens)

    def resident_bytes_at(self, context_tokens: int) -> int:
        """The bytes ``resident_tokens_at(C)`` tokens of C-token sessions take."""
        if context_tokens <= 0:
            return 0
        tokens = self.resident_tokens_at(context_tokens)
        return tokens * self.session_bytes(context_tokens) // context_tokens


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
        kv_layout=model.kv_layout,
        kv_dtype_bytes=model.dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes,
        weight_bytes=model.weight_bytes if weight_bytes is None else weight_bytes,
        total_memory_bytes=gpu_spec.memory_bytes * num_gpus,
        utilization=utilization,
    )
