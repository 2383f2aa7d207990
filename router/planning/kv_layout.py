"""What one sequence keeps in the KV cache, group of layers by group of layers.

A hybrid model mixes layers whose state grows differently with a sequence's length C:

* **full attention** keeps every token: GQA stores K and V per KV head
  (``2 x num_kv_heads x head_dim`` values), MLA one latent plus the decoupled RoPE key
  (``kv_lora_rank + qk_rope_head_dim``);
* **sliding-window attention** keeps the last ``window`` tokens, ``min(C, window)`` of them
  (vLLM's hybrid allocator frees the blocks that fall out of the window);
* a **compressed** cache (DeepSeek-V4) keeps one entry per ``stride`` tokens:
  ``min(C, window) // stride`` entries; the tokens of a group not yet complete wait in the
  compressor's state;
* a **sparse-attention indexer** (DeepSeek-V3.2, GLM-5, DeepSeek-V4) keeps one key per
  token, or per compressed entry, in its own FP8 format;
* **linear attention** (Qwen3-Next's gated delta net) keeps a fixed recurrent state per
  sequence, whatever its length.

So a sequence of C tokens holds ``bytes(C) = sum over groups of layers x (entries(C) x
entry bytes + state bytes)``. Only the groups with no window grow without bound; their
bytes per token are what a prefix cache indexes and what ``bytes_per_token`` reports.
Block rounding and the page padding an engine adds are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

LayerKind = Literal["full", "compressed", "indexer", "sliding", "recurrent"]
KIND_ORDER: tuple[LayerKind, ...] = ("full", "compressed", "indexer", "sliding", "recurrent")


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """``layers`` layers that each keep, for a sequence of C tokens, ``min(C, window) //
    stride`` entries of ``entry_width`` values and ``state_bytes`` that do not depend on C.

    Values are in the KV cache's dtype unless ``value_bytes`` fixes their size (an
    indexer's FP8 keys, a recurrent state in the model's dtype).
    """

    kind: LayerKind
    layers: int
    entry_width: int = 0
    window: int | None = None  # tokens kept; None: the whole context
    stride: int = 1  # tokens per entry
    value_bytes: float | None = None
    state_bytes: int = 0
    label: str = ""  # a full-attention layer's scheme: "GQA", "MLA"

    def entry_bytes(self, kv_dtype_bytes: float) -> float:
        per_value = kv_dtype_bytes if self.value_bytes is None else self.value_bytes
        return self.entry_width * per_value

    def growth_per_token(self, kv_dtype_bytes: float) -> float:
        """Bytes per token as C grows: none once a window is full."""
        if self.window is not None:
            return 0.0
        return self.layers * self.entry_bytes(kv_dtype_bytes) / self.stride

    def entries(self, context_tokens: int) -> int:
        kept = context_tokens if self.window is None else min(context_tokens, self.window)
        return kept // self.stride

    def token_bytes(self, context_tokens: int, kv_dtype_bytes: float) -> int:
        return int(self.layers * self.entries(context_tokens) * self.entry_bytes(kv_dtype_bytes))

    @property
    def fixed_bytes(self) -> int:
        return self.layers * self.state_bytes

    def same_shape(self, other: LayerGroup) -> bool:
        return replace(other, layers=self.layers) == self

    def describe(self) -> str:
        n = self.layers
        if self.kind == "full":
            return f"{n} full-attention {self.label} layers"
        if self.kind == "sliding":
            return f"{n} sliding-window (window {self.window:,}) layers"
        if self.kind == "compressed":
            return f"{n} compressed ({self.stride}:1) layers"
        if self.kind == "indexer":
            ratio = f", {self.stride}:1" if self.stride > 1 else ""
            return f"{n} sparse-attention indexers ({self.entry_width} bytes a key{ratio})"
        return f"{n} linear-attention layers ({self.state_bytes:,} bytes of state each)"


@dataclass(frozen=True, slots=True)
class KvLayout:
    """A model's layer groups: what a sequence of C tokens holds, whatever its kinds."""

    groups: tuple[LayerGroup, ...]

    @classmethod
    def of(cls, layers: list[LayerGroup]) -> KvLayout:
        """Per-layer groups merged into one group per shape: the growing kinds first, each
        kind's shapes in the order the layers come."""
        merged: list[LayerGroup] = []
        for layer in layers:
            for i, group in enumerate(merged):
                if layer.same_shape(group):
                    merged[i] = replace(group, layers=group.layers + layer.layers)
                    break
            else:
                merged.append(layer)
        return cls(tuple(sorted(merged, key=lambda g: KIND_ORDER.index(g.kind))))

    @property
    def is_hybrid(self) -> bool:
        """Whether a session's bytes are not ``C x bytes_per_token``: some layers keep a
        window, a state or one entry per several tokens."""
        return any(g.window is not None or g.state_bytes or g.stride > 1 for g in self.groups)

    def bytes_per_token(self, kv_dtype_bytes: float) -> int:
        """What each further token costs once every window is full: the growing groups."""
        return int(sum(g.growth_per_token(kv_dtype_bytes) for g in self.groups))

    def session_bytes(self, context_tokens: int, kv_dtype_bytes: float) -> int:
        return self.growing_bytes(context_tokens, kv_dtype_bytes) + self.overhead_bytes(
            context_tokens, kv_dtype_bytes
        )

    def growing_bytes(self, context_tokens: int, kv_dtype_bytes: float) -> int:
        """``C x bytes_per_token`` when every growing layer keeps an entry a token."""
        growing = [g for g in self.groups if g.window is None]
        if all(g.stride == 1 for g in growing):
            return context_tokens * self.bytes_per_token(kv_dtype_bytes)
        return sum(g.token_bytes(context_tokens, kv_dtype_bytes) for g in growing)

    def windowed_bytes(self, context_tokens: int, kv_dtype_bytes: float) -> int:
        return sum(
            g.token_bytes(context_tokens, kv_dtype_bytes)
            for g in self.groups
            if g.window is not None
        )

    @property
    def fixed_bytes(self) -> int:
        """Per sequence, whatever its length: recurrent and compressor states."""
        return sum(g.fixed_bytes for g in self.groups)

    def overhead_bytes(self, context_tokens: int, kv_dtype_bytes: float) -> int:
        return self.windowed_bytes(context_tokens, kv_dtype_bytes) + self.fixed_bytes

    def describe(self) -> str:
        return " + ".join(g.describe() for g in self.groups)
