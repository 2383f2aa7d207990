"""``kvrouter capacity``: how many tokens, and how many sessions, fit in a fleet's KV cache."""

from __future__ import annotations

import argparse
from typing import Any

from router.cli.help_format import DefaultsHelpFormatter
from router.planning.capacity import (
    GB,
    GPUS,
    CapacityError,
    CapacityPlan,
    ModelShape,
    dtype_bytes,
    gpu,
    load_model,
    plan,
    preset_names,
)
from router.planning.interruption import (
    DEFAULT_PREFILL_MFU,
    DEFAULT_RESTORE_GBPS,
    InterruptionCost,
    interruption,
)

DEFAULT_CONTEXT = 100_000
VLLM_DEFAULT_UTILIZATION = 0.9


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "capacity",
        help="plan KV-cache capacity in resident tokens and sessions",
        description="Bytes per token, tokens that fit after the weights, and sessions of a "
        "given context that fit, for a model on a set of GPUs.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model-config",
        default="llama-3.1-8b",
        help=f"config.json path or a preset: {', '.join(preset_names())}",
    )
    parser.add_argument("--gpu", default="h100", help=f"one of {', '.join(GPUS)}")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the model is spread over")
    parser.add_argument("--kv-dtype", default=None, help="KV cache dtype (none: the model's)")
    parser.add_argument(
        "--weights-gb",
        type=float,
        default=None,
        help="weights in GB (none: counted from the config)",
    )
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="tokens per session")
    parser.add_argument(
        "--sessions",
        type=int,
        default=None,
        help="also print the memory that this many sessions need",
    )
    parser.add_argument(
        "--utilization",
        type=float,
        default=VLLM_DEFAULT_UTILIZATION,
        help="fraction of GPU memory the engine may use (vLLM's "
        "--gpu-memory-utilization); the all-of-HBM ceiling is printed too",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="engines in the fleet, each of --gpus GPUs (for the failure figures)",
    )
    parser.add_argument(
        "--prefill-mfu",
        type=float,
        default=DEFAULT_PREFILL_MFU,
        help="fraction of peak dense BF16 FLOP/s a re-prefill sustains",
    )
    parser.add_argument(
        "--restore-gbps",
        type=float,
        default=DEFAULT_RESTORE_GBPS,
        help="GB/s each GPU reads a KV checkpoint back at (PCIe Gen5 x16, effective)",
    )
    parser.set_defaults(func=run)


def _gb(n: float) -> str:
    return f"{n / GB:,.1f} GB"


def run(args: argparse.Namespace) -> int:
    try:
        model = load_model(args.model_config)
        spec = gpu(args.gpu)
        kv_bytes = dtype_bytes(args.kv_dtype) if args.kv_dtype else None
        weights = int(args.weights_gb * GB) if args.weights_gb is not None else None
        ceiling = plan(model, spec, args.gpus, 1.0, kv_bytes, weights)
        usable = plan(model, spec, args.gpus, args.utilization, kv_bytes, weights)
        cost = interruption(
            usable,
            model,
            spec,
            args.gpus,
            args.workers,
            args.context,
            args.prefill_mfu,
            args.restore_gbps,
        )
    except CapacityError as exc:
        print(f"error: {exc}")
        return 2
    kv_desc = args.kv_dtype or f"{model.dtype_bytes:g} bytes"
    context = args.context
    print(f"model            {model.name} ({_shape(model)}), KV dtype {kv_desc}")
    if model.is_hybrid:
        windowed, fixed = ceiling.overhead_bytes(context)
        print(f"bytes per token  {ceiling.bytes_per_token:,} as a session grows")
        print(
            f"per session      + {windowed:,} bytes in windows + {fixed:,} bytes of fixed "
            f"state (at {context:,} tokens)"
        )
    else:
        print(f"bytes per token  {ceiling.bytes_per_token:,}")
    print(f"weights          {_gb(ceiling.weight_bytes)}")
    print(
        f"GPU memory       {args.gpus} x {spec.name} ({_gb(spec.memory_bytes)}) = "
        f"{_gb(ceiling.total_memory_bytes)}"
    )
    print(f"one session      {context:,} tokens = {_gb(ceiling.session_bytes(context))}")
    if args.sessions:
        needed = args.sessions * ceiling.session_bytes(context)
        print(f"{args.sessions} sessions      {_gb(needed)}")
    print()
    print(f"{'':28}{'all of HBM':>16}{f'at {args.utilization:.2f}':>16}")
    for label, a, b in _rows(ceiling, usable, context, model.is_hybrid):
        print(f"{label:28}{a:>16}{b:>16}")
    if ceiling.resident_tokens == 0:
        print("\nthe weights alone do not fit: add GPUs or quantize")
        return 0
    print()
    _print_interruption(cost, args)
    return 0


def _shape(model: ModelShape) -> str:
    if model.attention == "mla":
        heads = f"kv_lora_rank {model.kv_lora_rank} + qk_rope_head_dim {model.qk_rope_head_dim}"
    else:
        heads = f"{model.num_kv_heads} KV heads x {model.head_dim}"
    if model.is_hybrid:
        return f"hybrid: {model.kv_layout.describe()}; {heads}"
    shape = f"{model.attention.upper()}, {model.num_layers} layers, {heads}"
    extra = model.kv_layout.groups[1:]
    return "; ".join([shape, *(g.describe() for g in extra)])


def _rows(
    ceiling: CapacityPlan, usable: CapacityPlan, context: int, hybrid: bool
) -> list[tuple[str, str, str]]:
    """A hybrid model's resident tokens depend on the session length: at ``context``, and
    the bound they approach as sessions grow."""
    sessions = (
        f"sessions of {context:,} tokens",
        f"{ceiling.sessions_that_fit(context):,}",
        f"{usable.sessions_that_fit(context):,}",
    )
    kv = ("KV memory after weights", _gb(ceiling.kv_bytes), _gb(usable.kv_bytes))
    unbounded = f"{ceiling.resident_tokens:,}", f"{usable.resident_tokens:,}"
    if not hybrid:
        return [kv, ("resident tokens", *unbounded), sessions]
    at_context = (
        f"resident tokens at {context:,}",
        f"{ceiling.resident_tokens_at(context):,}",
        f"{usable.resident_tokens_at(context):,}",
    )
    return [kv, at_context, sessions, ("resident tokens, C -> inf", *unbounded)]


def _seconds(s: float) -> str:
    if s >= 3600:
        return f"{s:,.0f} s ({s / 3600:.1f} h)"
    if s >= 100:
        return f"{s:,.0f} s"
    return f"{s:.1f} s"


def _print_interruption(cost: InterruptionCost, args: argparse.Namespace) -> None:
    """The "If a worker fails" section: one worker's full cache lost, two ways back."""
    spec = gpu(args.gpu)
    print(
        f"If a worker fails (1 of {args.workers}, each {args.gpus} x {spec.name}, "
        f"its cache full at {args.utilization:.2f})"
    )
    print(
        f"{'tokens at risk':28}{cost.tokens_at_risk:,} ({cost.share_of_fleet:.1%} of the "
        f"fleet's {cost.fleet_tokens:,})"
    )
    print(
        f"{'re-prefill rate':28}{cost.prefill_tokens_per_s:,.0f} tokens/s a worker "
        f"({args.context:,}-token prefills; attention"
    )
    print(
        f"{'':28}is {cost.attention_share:.0%} of the FLOPs), at MFU {args.prefill_mfu:.2f} "
        f"of {args.gpus} x {spec.dense_bf16_flops / 1e12:,.0f} TFLOP/s BF16"
    )
    print("without a checkpoint        re-prefill every token at risk")
    print(f"{'  on one worker':28}{_seconds(cost.rebuild_seconds)}")
    fleet = cost.fleet_rebuild_seconds
    survivors = args.workers - 1
    spread = _seconds(fleet) if fleet is not None else "no survivors: the sessions wait"
    print(f"{f'  across {survivors} survivors':28}{spread}")
    print("with a checkpoint           re-prefill 0 s; restore the cache")
    print(f"{'  checkpoint':28}{cost.checkpoint_bytes:,} bytes ({_gb(cost.checkpoint_bytes)})")
    print(
        f"{'  restore':28}{_seconds(cost.restore_seconds)} at {args.restore_gbps:g} GB/s "
        f"x {args.gpus} GPU{'s' if args.gpus > 1 else ''}"
    )
    print(
        f"{'':28}KV only: the weights ({_gb(cost.weight_bytes)}) reload too, "
        f"{_seconds(cost.weights_reload_seconds)} at the same rate"
    )
