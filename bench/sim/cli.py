"""``kvrouter sim engine`` and ``kvrouter sim fleet``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from typing import Any

import orjson

from bench.sim.config import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_OFFLOAD_GBPS,
    DEFAULT_RESPONSES_STORE_MAX,
    DEFAULT_STREAM_FLUSH_WALL_S,
    DEFAULT_TIME_SCALE,
    DEFAULT_TOOL_CALL_PARSER,
    KV_EVENTS_CONFIGS,
    EngineConfig,
)
from bench.sim.vllm_hash import HASH_FUNCTIONS
from router.cli.help_format import DefaultsHelpFormatter
from router.errors import ConfigError
from router.planning.capacity import (
    GPUS,
    CapacityError,
    ModelShape,
    dtype_bytes,
    gpu,
    load_model,
    preset_names,
)
from router.tokens.model import ModelTokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL = "llama-3.1-8b"
DEFAULT_BASE_PORT = 8100


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--flavor",
        choices=["vllm", "sglang"],
        default="vllm",
        help="whose API extras and metric names to serve",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"preset ({', '.join(preset_names())}) or a config.json path",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send (default: the --model name)",
    )
    parser.add_argument("--gpu", default="h100", help=f"one of {', '.join(GPUS)}")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per engine")
    parser.add_argument("--kv-cache-dtype", default=None, help="e.g. fp8 (default: the model's)")
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="KV cache size in tokens (overrides the GPU-memory computation)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        help="as vLLM's: the share of GPU memory for weights and KV cache",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_TOKENS,
        help="tokens per KV block, as vLLM's (CPU vLLM takes multiples of 32 only)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_MAX_NUM_SEQS,
        help="as vLLM's: requests running at once",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="as vLLM's: tokens a step schedules (longer prefills are chunked)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="as vLLM's: the longest prompt plus output (none: the model's)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=DEFAULT_TIME_SCALE,
        help="run this many times faster than real time (ratios are kept)",
    )
    parser.add_argument("--stream-interval", type=int, default=1, help="tokens per streamed chunk")
    parser.add_argument(
        "--stream-flush-ms",
        type=float,
        default=DEFAULT_STREAM_FLUSH_WALL_S * 1e3,
        help="while decoding, send tokens at least this often (wall-clock "
        "ms) instead of every step; 0 sends every step",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for the generated text")
    parser.add_argument(
        "--api-key", default=None, help="as vLLM's: /v1 routes want 'Authorization: Bearer KEY'"
    )
    parser.add_argument(
        "--kv-events-config",
        default=None,
        help="as vLLM's (SGLang's with --flavor sglang), JSON: publish KV events over ZMQ, "
        'e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\' '
        '(SGLang: \'{"publisher": "zmq", "endpoint": "tcp://*:5557"}\')',
    )
    parser.add_argument(
        "--prefix-caching-hash-algo",
        choices=sorted(HASH_FUNCTIONS),
        default="sha256",
        help="as vLLM's: how block hashes are computed (they name blocks in KV events)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="as vLLM's: a model directory (tokenizer.json, tokenizer_config.json with its "
        "chat template) whose ids prompts are encoded to (default: 4-byte stand-in tokens)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=DEFAULT_TOOL_CALL_PARSER,
        choices=(DEFAULT_TOOL_CALL_PARSER, "none"),
        help="as vLLM's --enable-auto-tool-choice --tool-call-parser NAME: chat replies "
        "call the tools tool_choice asks for; 'none': refused as vLLM without a parser",
    )
    parser.add_argument(
        "--enable-responses-store",
        action="store_true",
        help="as vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1: keep /v1/responses answers for "
        "GET, cancel and previous_response_id",
    )
    parser.add_argument(
        "--responses-store-max",
        type=int,
        default=DEFAULT_RESPONSES_STORE_MAX,
        help="stored responses kept, the oldest forgotten first (vLLM keeps all)",
    )
    parser.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        metavar="GIB",
        help="as vLLM's: a CPU tier of this many GiB behind the GPU's KV cache; every "
        "cached block is written there, and a prompt continuing its GPU hit there is "
        "loaded back over the host link",
    )
    parser.add_argument(
        "--kv-offloading-backend",
        choices=("native",),
        default="native",
        help="as vLLM's (its native offloading connector)",
    )
    parser.add_argument(
        "--kv-transfer-config",
        default=None,
        help="as vLLM's, JSON; only "
        '\'{"kv_connector_extra_config": {"self_describing_kv_events": true}}\' is read: '
        "the CPU tier's KV events carry tokens and parents (vLLM's default: placeholders)",
    )
    parser.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        metavar="TOKENS",
        help="a hybrid model's sliding-window layers: their window (default: the model's "
        "config, e.g. gemma-3-27b's 1,024; 0: none)",
    )
    parser.add_argument(
        "--window-groups",
        type=int,
        default=None,
        help="KV cache groups vLLM makes of them (default: sliding layers over "
        "full-attention layers)",
    )
    parser.add_argument(
        "--kv-offloading-gbps",
        type=float,
        default=DEFAULT_OFFLOAD_GBPS,
        help="GB/s per GPU a load from the CPU tier crosses the host link at",
    )


def engine_config(args: argparse.Namespace, engine_id: str = "0") -> EngineConfig:
    """Build and validate an engine config from parsed flags (raises ``ValueError``)."""
    model = load_model(args.model)
    return EngineConfig(
        model=model,
        gpu=gpu(args.gpu),
        served_model_name=args.served_model_name or model.name,
        flavor=args.flavor,
        tensor_parallel_size=args.tp,
        kv_cache_dtype_bytes=(
            int(dtype_bytes(args.kv_cache_dtype)) if args.kv_cache_dtype else None
        ),
        kv_tokens=args.kv_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_tokens=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        time_scale=args.time_scale,
        stream_interval=args.stream_interval,
        stream_flush_wall_s=args.stream_flush_ms / 1e3,
        seed=args.seed,
        api_key=args.api_key,
        engine_id=engine_id,
        kv_events=(
            KV_EVENTS_CONFIGS[args.flavor].from_cli(args.kv_events_config)
            if args.kv_events_config
            else None
        ),
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        tokenizer=args.tokenizer,
        responses_store=args.enable_responses_store,
        responses_store_max=args.responses_store_max,
        tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
        restore=getattr(args, "restore", None),
        kv_offloading_bytes=(
            int(args.kv_offloading_size * GIB) if args.kv_offloading_size is not None else None
        ),
        kv_offloading_gbps=args.kv_offloading_gbps,
        kv_offloading_self_describing_events=self_describing_offload_events(
            args.kv_transfer_config
        ),
        **window_settings(model, args.sliding_window, args.window_groups),
    )


def window_settings(model: ModelShape, window: int | None, groups: int | None) -> dict[str, Any]:
    """``EngineConfig``'s sliding_window and window_groups: as given, else the model's
    (vLLM makes as many window groups as its sliding layers fill groups the size of its
    full-attention one)."""
    sliding = [g for g in model.kv_layout.groups if g.kind == "sliding"]
    full = sum(g.layers for g in model.kv_layout.groups if g.kind == "full")
    if window is None and sliding and sliding[0].window is not None:
        window = sliding[0].window
    if not window:
        return {}
    if groups is None:
        layers = sum(g.layers for g in sliding) or full
        groups = max(1, layers // max(1, full))
    return {"sliding_window": window, "window_groups": groups}


GIB = 1 << 30
SELF_DESCRIBING = "self_describing_kv_events"


def self_describing_offload_events(kv_transfer_config: str | None) -> bool:
    """The one field of vLLM's --kv-transfer-config the simulator reads (ValueError for
    anything else in it)."""
    if kv_transfer_config is None:
        return False
    try:
        raw = orjson.loads(kv_transfer_config)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"--kv-transfer-config is not JSON: {exc}") from None
    extra = raw.get("kv_connector_extra_config") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or set(raw) != {"kv_connector_extra_config"}:
        raise ValueError("--kv-transfer-config: only kv_connector_extra_config is simulated")
    if not isinstance(extra, dict) or set(extra) - {SELF_DESCRIBING}:
        raise ValueError(f"--kv-transfer-config: only {SELF_DESCRIBING} is simulated")
    value = extra.get(SELF_DESCRIBING, False)
    if not isinstance(value, bool):
        raise ValueError(f"{SELF_DESCRIBING} is true or false")
    return value


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The flags that rebuild ``args``' engine options in a child process."""
    flags = [
        "--host",
        args.host,
        "--flavor",
        args.flavor,
        "--model",
        args.model,
        "--gpu",
        args.gpu,
        "--tp",
        str(args.tp),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        "--block-size",
        str(args.block_size),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--time-scale",
        str(args.time_scale),
        "--stream-interval",
        str(args.stream_interval),
        "--stream-flush-ms",
        str(args.stream_flush_ms),
        "--prefix-caching-hash-algo",
        args.prefix_caching_hash_algo,
        "--responses-store-max",
        str(args.responses_store_max),
        "--tool-call-parser",
        args.tool_call_parser,
        "--kv-offloading-gbps",
        str(args.kv_offloading_gbps),
    ]
    if args.enable_responses_store:
        flags.append("--enable-responses-store")
    optional = {
        "--served-model-name": args.served_model_name,
        "--kv-cache-dtype": args.kv_cache_dtype,
        "--kv-tokens": args.kv_tokens,
        "--max-model-len": args.max_model_len,
        "--api-key": args.api_key,
        "--tokenizer": args.tokenizer,
        "--kv-offloading-size": args.kv_offloading_size,
        "--kv-transfer-config": args.kv_transfer_config,
        "--sliding-window": args.sliding_window,
        "--window-groups": args.window_groups,
    }
    for flag, value in optional.items():
        if value is not None:
            flags += [flag, str(value)]
    return flags


def register(commands: argparse._SubParsersAction[Any]) -> None:
    sim = commands.add_parser("sim", help="simulated vLLM / SGLang engines")
    sub = sim.add_subparsers(dest="sim_command", required=True, metavar="SIM_COMMAND")
    engine = sub.add_parser(
        "engine",
        help="one simulated engine on one port",
        formatter_class=DefaultsHelpFormatter,
    )
    engine.add_argument("--port", type=int, default=8000, help="port to listen on")
    engine.add_argument("--engine-id", default="0", help="the 'engine' metric label")
    engine.add_argument(
        "--restore",
        default=None,
        metavar="FILE",
        help="start from a checkpoint (POST /sim/checkpoint) taken against the same model, "
        "block size, capacity and hashing, as a process restored from a GPU checkpoint",
    )
    add_engine_arguments(engine)
    engine.set_defaults(func=run_engine)
    fleet = sub.add_parser(
        "fleet",
        help="N simulated engines, each in its own process and port",
        formatter_class=DefaultsHelpFormatter,
    )
    fleet.add_argument("--n", type=int, default=4, help="engines")
    fleet.add_argument(
        "--base-port", type=int, default=DEFAULT_BASE_PORT, help="engine i listens on this + i"
    )
    fleet.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        metavar="BASE",
        help="publish KV events: engine i on port BASE+2i, its replay socket on BASE+2i+1 "
        "(other fields from --kv-events-config)",
    )
    add_engine_arguments(fleet)
    fleet.set_defaults(func=run_fleet)


def _run(coro: Any) -> int:
    with contextlib.suppress(KeyboardInterrupt):
        try:
            import uvloop
        except ImportError:
            asyncio.run(coro)
        else:
            uvloop.run(coro)
    return 0


def _checked_config(args: argparse.Namespace, engine_id: str = "0") -> EngineConfig | None:
    """The engine config of ``args``, its tokenizer read once to check it; None (the
    error printed) when either is wrong."""
    try:
        config = engine_config(args, engine_id)
        if config.tokenizer is not None:
            ModelTokenizer.from_dir(config.tokenizer)
        if config.restore is not None:
            check_restore(config)
    except (CapacityError, ConfigError, ValueError) as exc:
        print(f"error: {exc}")
        return None
    return config


def check_restore(config: EngineConfig) -> None:
    """Raise ``CheckpointError`` if ``config.restore`` is not a checkpoint of the engine
    ``config`` builds (read once more when the engine starts)."""
    from bench.sim import checkpoint
    from bench.sim.engine import Engine

    assert config.restore is not None
    checkpoint.check(Engine(config), checkpoint.read(config.restore))


def run_engine(args: argparse.Namespace) -> int:
    from bench.sim.engine import kv_capacity_tokens
    from bench.sim.http1 import serve

    config = _checked_config(args, args.engine_id)
    if config is None:
        return 2
    log.info(
        "simulated %s engine %s on http://%s:%d: model %s on %dx %s, %d KV tokens, time scale %g",
        config.flavor,
        config.engine_id,
        args.host,
        args.port,
        config.served_model_name,
        config.tensor_parallel_size,
        config.gpu.name,
        kv_capacity_tokens(config),
        config.time_scale,
    )
    return _run(serve(config, args.host, args.port))


def run_fleet(args: argparse.Namespace) -> int:
    from bench.sim.fleet import KVEventPorts, run_fleet_forever

    if _checked_config(args) is None:
        return 2
    if args.kv_events_config is not None and args.kv_events_port is None:
        print("error: a fleet's engines publish KV events on ports of their own: --kv-events-port")
        return 2
    kv_events = None
    if args.kv_events_port is not None:
        kv_events = KVEventPorts(args.kv_events_port, args.kv_events_config)
    return _run(run_fleet_forever(args.n, args.host, args.base_port, engine_flags(args), kv_events))
