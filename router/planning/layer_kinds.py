"""A model's layer kinds, read from its Hugging Face ``config.json``.

Which layers attend to the whole context, which to a window, which keep a recurrent state:

* ``layer_types`` (Gemma 3, GPT-OSS, Qwen3-Next): per layer ``full_attention``,
  ``sliding_attention`` (``sliding_window`` tokens) or ``linear_attention``;
* else ``full_attention_interval`` (Qwen3-Next): every n-th layer full, the others linear,
  as transformers' ``Qwen3NextConfig`` spells it out;
* else ``sliding_window_pattern`` (Gemma 3, whose transformers default is 6): every n-th
  layer full, the others sliding;
* ``index_head_dim`` (DeepSeek-V3.2, GLM-5): a sparse-attention indexer beside each layer,
  or beside the ``full`` ones of ``indexer_types``;
* ``compress_ratios`` (DeepSeek-V4), or its ``layer_types`` with ``compress_rates``: see
  ``_compressed_layers``.

The formats are vLLM's: an indexer key is ``index_head_dim`` FP8 values plus one FP32 scale
per 128 (``DeepseekV32IndexerCache``); a gated delta net keeps a causal-convolution state of
``(linear_conv_kernel_dim - 1) x (2 x key heads x key dim + value heads x value dim)``
values and a recurrent state of ``value heads x key dim x value dim``, both in the model's
dtype unless ``mamba_ssm_dtype`` sets the recurrent one (``MambaStateShapeCalculator.
gated_delta_net_state_shape`` and ``MambaStateDtypeCalculator``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.planning.kv_layout import KvLayout, LayerGroup

FP32_BYTES = 4
INDEXER_SCALE_BLOCK = 128
DEFAULT_SLIDING_PATTERN = {"gemma3": 6, "gemma3_text": 6}
V4_KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
KNOWN_KINDS = ("full_attention", "sliding_attention", "linear_attention")


class LayerKindError(ValueError):
    """A config whose layer kinds the capacity math cannot read."""


def read_layout(
    config: Mapping[str, Any], layers: int, full: LayerGroup, state: tuple[float, float]
) -> KvLayout:
    """``full`` is one full-attention layer of the model; ``state`` the bytes of a value of
    a linear-attention layer's convolution and recurrent states."""
    if config.get("compress_ratios") or config.get("compress_rates"):
        return KvLayout.of(_compressed_layers(config, layers))
    groups = [_layer(kind, config, full, state) for kind in _layer_types(config, layers)]
    index_head_dim = config.get("index_head_dim")
    if index_head_dim:
        groups += [_indexer(int(index_head_dim), 1)] * _indexed_layers(config, layers)
    return KvLayout.of(groups)


def _layer_types(config: Mapping[str, Any], layers: int) -> list[str]:
    given = config.get("layer_types")
    if given:
        if len(given) < layers:
            raise LayerKindError(f"layer_types lists {len(given)} layers, not {layers}")
        return [str(kind) for kind in given[:layers]]
    interval = config.get("full_attention_interval")
    if interval:
        return _every_nth_full(int(interval), layers, "linear_attention")
    pattern = (
        config.get("sliding_window_pattern")
        or config.get("_sliding_window_pattern")
        or DEFAULT_SLIDING_PATTERN.get(str(config.get("model_type")))
    )
    if pattern and config.get("sliding_window"):
        return _every_nth_full(int(pattern), layers, "sliding_attention")
    return ["full_attention"] * layers


def _every_nth_full(n: int, layers: int, other: str) -> list[str]:
    return ["full_attention" if (i + 1) % n == 0 else other for i in range(layers)]


def _layer(
    kind: str, config: Mapping[str, Any], full: LayerGroup, state: tuple[float, float]
) -> LayerGroup:
    if kind == "full_attention":
        return full
    if kind == "sliding_attention":
        return LayerGroup("sliding", 1, full.entry_width, window=_int(config, "sliding_window"))
    if kind == "linear_attention":
        return _gated_delta_net(config, *state)
    raise LayerKindError(f"unknown layer type {kind!r}; known: {', '.join(KNOWN_KINDS)}")


def _gated_delta_net(config: Mapping[str, Any], conv_bytes: float, ssm_bytes: float) -> LayerGroup:
    k_heads, k_dim = _int(config, "linear_num_key_heads"), _int(config, "linear_key_head_dim")
    v_heads, v_dim = _int(config, "linear_num_value_heads"), _int(config, "linear_value_head_dim")
    conv = (_int(config, "linear_conv_kernel_dim") - 1) * (2 * k_heads * k_dim + v_heads * v_dim)
    recurrent = v_heads * k_dim * v_dim
    return LayerGroup("recurrent", 1, state_bytes=int(conv * conv_bytes + recurrent * ssm_bytes))


def _indexed_layers(config: Mapping[str, Any], layers: int) -> int:
    kinds = config.get("indexer_types")
    return sum(kind == "full" for kind in kinds[:layers]) if kinds else layers


def _indexer(index_head_dim: int, stride: int, state_bytes: int = 0) -> LayerGroup:
    width = index_head_dim + index_head_dim // INDEXER_SCALE_BLOCK * FP32_BYTES
    return LayerGroup("indexer", 1, width, stride=stride, value_bytes=1, state_bytes=state_bytes)


def _compressed_layers(config: Mapping[str, Any], layers: int) -> list[LayerGroup]:
    """DeepSeek-V4: every layer keeps its last ``sliding_window`` tokens, one
    ``head_dim``-wide latent a token (K = V); a layer of ratio r > 1 also keeps one entry
    per r tokens, and the r = 4 layers (the only ones with an indexer, in DeepSeek's
    inference code and vLLM's) an indexer key per entry. A compressor's unfinished group is
    FP32 state: ``coff x r`` rows of ``2 x coff x width`` (KV and score), where coff = 2 if
    groups overlap (r = 4) and 1 otherwise (vLLM's ``CompressorStateCache``)."""
    head_dim = _int(config, "head_dim")
    groups = [LayerGroup("sliding", 1, head_dim, window=_int(config, "sliding_window"))] * layers
    for ratio in _compress_ratios(config, layers):
        if ratio <= 1:
            continue
        state = _compressor_state(ratio, head_dim)
        groups.append(LayerGroup("compressed", 1, head_dim, stride=ratio, state_bytes=state))
        if ratio == 4:
            index_dim = _int(config, "index_head_dim")
            groups.append(_indexer(index_dim, ratio, _compressor_state(ratio, index_dim)))
    return groups


def _compress_ratios(config: Mapping[str, Any], layers: int) -> list[int]:
    """Per layer; a list longer than the model also covers its MTP layers."""
    ratios = config.get("compress_ratios")
    if ratios:
        if len(ratios) < layers:
            raise LayerKindError(f"compress_ratios lists {len(ratios)} layers, not {layers}")
        return [int(r) for r in ratios[:layers]]
    rates = {"sliding_attention": 0, **config["compress_rates"]}
    kinds = _layer_types(config, layers)
    unknown = sorted(set(kinds) - set(rates))
    if unknown:
        raise LayerKindError(f"unknown layer types {unknown}; known: {', '.join(V4_KINDS)}")
    return [int(rates[kind]) for kind in kinds]


def _compressor_state(ratio: int, width: int) -> int:
    coff = 2 if ratio == 4 else 1
    return coff * ratio * 2 * coff * width * FP32_BYTES


def _int(config: Mapping[str, Any], key: str) -> int:
    try:
        return int(config[key])
    except (KeyError, TypeError, ValueError) as exc:
        raise LayerKindError(f"config needs {key} for its layer kinds ({exc!r})") from exc
