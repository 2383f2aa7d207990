"""Typed, validated configuration of one simulated engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bench.sim.kv_events import KVEventsConfig
from bench.sim.sglang_kv_events import SglangKVEventsConfig
from bench.sim.vllm_hash import HASH_FUNCTIONS
from router.planning.capacity import GpuSpec, ModelShape
from router.planning.interruption import DEFAULT_PREFILL_MFU, DEFAULT_RESTORE_GBPS

Flavor = Literal["vllm", "sglang"]

# Each flavour's --kv-events-config: its fields, its events and its publisher.
KV_EVENTS_CONFIGS: dict[Flavor, type[KVEventsConfig] | type[SglangKVEventsConfig]] = {
    "vllm": KVEventsConfig,
    "sglang": SglangKVEventsConfig,
}

DEFAULT_BLOCK_TOKENS = 16
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_TIME_SCALE = 1.0
# Fraction of peak dense FLOP/s a prefill achieves (model FLOPs utilisation): the
# capacity planner's re-prefill figures assume the same.
DEFAULT_PREFILL_EFFICIENCY = DEFAULT_PREFILL_MFU
# Fraction of peak HBM bandwidth a decode step achieves.
DEFAULT_DECODE_EFFICIENCY = 0.7
# Fixed per-step cost: scheduling, sampling, kernel launches (seconds, simulated).
DEFAULT_STEP_OVERHEAD_S = 0.002
DEFAULT_STREAM_FLUSH_WALL_S = 0.1
# Stored Responses API responses an engine keeps (vLLM keeps every one; see
# bench/sim/responses_store.py).
DEFAULT_RESPONSES_STORE_MAX = 10_000
# Qwen3's tool calls are written in the Hermes format, which vLLM's parser of that name reads.
DEFAULT_TOOL_CALL_PARSER = "hermes"
# A load from the CPU tier crosses PCIe as a checkpoint's restore does.
DEFAULT_OFFLOAD_GBPS = DEFAULT_RESTORE_GBPS


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelShape
    gpu: GpuSpec
    served_model_name: str
    flavor: Flavor = "vllm"
    tensor_parallel_size: int = 1
    kv_cache_dtype_bytes: int | None = None  # None: the model's dtype
    kv_tokens: int | None = None  # overrides the capacity computed from GPU memory
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    time_scale: float = DEFAULT_TIME_SCALE
    prefill_efficiency: float = DEFAULT_PREFILL_EFFICIENCY
    decode_efficiency: float = DEFAULT_DECODE_EFFICIENCY
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S
    stream_interval: int = 1  # tokens per streamed chunk, as vLLM's --stream-interval
    # While a batch decodes, its tokens go out at least this often (wall-clock seconds)
    # rather than every step: at high time scales a step is far shorter than the time
    # it takes to stream one chunk. 0 sends every step. The first token always goes
    # out at its exact step.
    stream_flush_wall_s: float = DEFAULT_STREAM_FLUSH_WALL_S
    seed: int = 0
    engine_id: str = "0"
    # As vLLM's --api-key: every /v1 route wants "Authorization: Bearer <key>".
    api_key: str | None = None
    # As vLLM's --kv-events-config and --prefix-caching-hash-algo; with the sglang
    # flavour, SGLang's --kv-events-config (its events, hashes and publisher).
    kv_events: KVEventsConfig | SglangKVEventsConfig | None = None
    prefix_caching_hash_algo: str = "sha256"
    # As vLLM's --tokenizer: a model directory (tokenizer.json, tokenizer_config.json with
    # its chat template) whose ids prompts are encoded to; None: the stand-in tokens.
    tokenizer: str | None = None
    # As vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1 (off by default, as there): keep
    # /v1/responses answers for GET, cancel and previous_response_id; at most
    # responses_store_max of them, the oldest forgotten first (vLLM's store is unbounded).
    responses_store: bool = False
    responses_store_max: int = DEFAULT_RESPONSES_STORE_MAX
    # As vLLM's --enable-auto-tool-choice --tool-call-parser NAME, as a fleet serving agents
    # runs it: chat replies may call the tools a request offers, and
    # vllm:tool_call_parser_invocations counts the parser's work. None: as vLLM without
    # them, a tool_choice other than "none" is refused.
    tool_call_parser: str | None = DEFAULT_TOOL_CALL_PARSER
    # A checkpoint file (``bench/sim/checkpoint.py``) the engine starts from, as a
    # process restored from a GPU checkpoint; None: an empty cache.
    restore: str | None = None
    # As vLLM's --kv-offloading-backend native --kv-offloading-size (in bytes here): a
    # CPU tier of this size behind the GPU's cache (``bench/sim/offload.py``); None: none.
    kv_offloading_bytes: int | None = None
    # The host link a load from that tier crosses, per GPU (GB/s, decimal).
    kv_offloading_gbps: float = DEFAULT_OFFLOAD_GBPS
    # As the offloading connector's kv_connector_extra_config "self_describing_kv_events":
    # the tier's BlockStored events carry tokens and parents; off (vLLM's default) they
    # are placeholders (the block's hash alone).
    kv_offloading_self_describing_events: bool = False
    # A hybrid model's sliding-window layers (``bench/sim/windows.py``): their window in
    # tokens and how many KV cache groups vLLM makes of them; None: every layer keeps
    # the whole context.
    sliding_window: int | None = None
    window_groups: int = 0

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str]] = [
            (
                self.prefix_caching_hash_algo in HASH_FUNCTIONS,
                f"prefix_caching_hash_algo must be one of {', '.join(HASH_FUNCTIONS)}",
            ),
            (self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
            (
                self.kv_tokens is None or self.kv_tokens >= self.block_tokens,
                "kv_tokens must hold at least one block",
            ),
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"),
            (self.block_tokens >= 1, "block_tokens must be >= 1"),
            (
                self.kv_events is None
                or isinstance(self.kv_events, KV_EVENTS_CONFIGS[self.flavor]),
                f"kv_events must be a {KV_EVENTS_CONFIGS[self.flavor].__name__} "
                f"for a {self.flavor} engine",
            ),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (self.time_scale > 0, "time_scale must be > 0"),
            (0 < self.prefill_efficiency <= 1, "prefill_efficiency must be in (0, 1]"),
            (0 < self.decode_efficiency <= 1, "decode_efficiency must be in (0, 1]"),
            (self.step_overhead_s >= 0, "step_overhead_s must be >= 0"),
            (self.stream_interval >= 1, "stream_interval must be >= 1"),
            (self.stream_flush_wall_s >= 0, "stream_flush_wall_s must be >= 0"),
            (self.responses_store_max >= 1, "responses_store_max must be >= 1"),
            (
                self.kv_offloading_bytes is None or self.kv_offloading_bytes > 0,
                "kv_offloading_bytes must be > 0",
            ),
            (self.kv_offloading_gbps > 0, "kv_offloading_gbps must be > 0"),
            (
                self.kv_offloading_bytes is None or self.flavor == "vllm",
                "an offload tier is vLLM's (--kv-offloading-size)",
            ),
            (
                (self.sliding_window is None) == (self.window_groups == 0),
                "sliding_window and window_groups: give both or neither",
            ),
            (
                self.sliding_window is None or (self.sliding_window > 1 and self.window_groups > 0),
                "sliding_window must be > 1 token and window_groups > 0",
            ),
            (
                self.sliding_window is None or self.flavor == "vllm",
                "window groups are vLLM's hybrid allocator's",
            ),
            (
                self.sliding_window is None or self.kv_offloading_bytes is None,
                "an offload tier beside window groups is not simulated",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
