"""How the router's blocks relate to an engine's own.

In token and exact mode the router keys prompts by blocks of ``prefix.block_bytes / 4``
tokens (16 by default, vLLM's smallest common size). An engine caches whole blocks of its
own size, read from its ``vllm:cache_config_info`` or its KV events: when that size is a
multiple of the router's, each engine block is a run of router blocks, so the router's
model of the engine holds exactly what the engine holds, and a prefix the router matches
counts only in the engine's whole blocks. Workers of different block sizes share one key.
"""

from __future__ import annotations

import math

from router.wire.blocks import TOKEN_BYTES


def whole_engine_blocks(tokens: int, engine_block: int | None) -> int:
    """``tokens`` of a matched prefix, less the part of the engine's last block it does
    not fill (an engine caches whole blocks only)."""
    if not engine_block or engine_block <= 1:
        return tokens
    return tokens - tokens % engine_block


def divides(router_block: int, engine_block: int) -> bool:
    """The engine's blocks are whole runs of the router's."""
    return engine_block % router_block == 0


def block_size_advice(engine_block: int, router_block: int) -> str:
    """Why a worker's blocks do not fit the router's, and the setting that fits."""
    fitting = math.gcd(engine_block, router_block) * TOKEN_BYTES
    return (
        f"its engine's blocks are {engine_block} tokens, not a whole number of the "
        f"router's {router_block}-token blocks (set prefix.block_bytes: {fitting})"
    )
