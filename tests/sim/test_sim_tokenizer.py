"""``kvrouter sim engine --tokenizer DIR``: the simulated engine's prompts are the model's
own ids, as vLLM renders and encodes them, checked over real loopback HTTP against
transformers' ``apply_chat_template`` and ``encode`` on the same model directory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bench.ports import free_port
from bench.sim.kv_events import KVEventsConfig
from bench.textgen import text_for
from router.index import events as wire
from tests.conftest import TEST_MODEL, RunningEngine, engine_config
from tests.sim.test_sim_kv_events import replay_from
from tests.sim_servers import FRONTS, post, serve_engine_on

BLOCK = 16
MESSAGES = [
    {"role": "system", "content": "You are a careful coding agent. " + text_for("sys", 120)},
    {"role": "user", "content": "Read the file and fix the bug: " + text_for("u1", 60)},
]


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> PreTrainedTokenizerBase:
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
    return tokenizer


@pytest.fixture(params=FRONTS)
async def sim(request: pytest.FixtureRequest, model_dir: Path) -> AsyncIterator[RunningEngine]:
    config = engine_config(tokenizer=str(model_dir))
    async with serve_engine_on(request.param, config) as running:
        yield running


def chat_ids(reference: PreTrainedTokenizerBase, messages: list[dict[str, Any]], **kw: Any) -> Any:
    kw.setdefault("add_generation_prompt", True)
    return reference.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


async def test_a_chat_prompt_is_the_models_ids_and_the_next_turn_hits_their_blocks(
    sim: RunningEngine, reference: PreTrainedTokenizerBase
) -> None:
    expected = chat_ids(reference, MESSAGES)
    async with aiohttp.ClientSession() as http:
        body = {"model": TEST_MODEL, "messages": MESSAGES, "max_tokens": 8, "ignore_eos": True}
        first = await post(http, f"{sim.url}/v1/chat/completions", body)
        tokens = await post(http, f"{sim.url}/tokenize", {"messages": MESSAGES})
        reply = first["choices"][0]["message"]["content"]
        turn = [*MESSAGES, {"role": "assistant", "content": reply}]
        turn.append({"role": "user", "content": "Now run the tests: " + text_for("u2", 30)})
        second = await post(http, f"{sim.url}/v1/chat/completions", {**body, "messages": turn})
    assert first["usage"]["prompt_tokens"] == len(expected)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert tokens["tokens"] == expected and tokens["count"] == len(expected)
    # The second turn hits exactly the whole blocks its ids share with what the first
    # computed: its prompt and its reply but the last token. The reply's words are the
    # vocabulary's own, so the reply's text encodes back to the ids generated.
    expected_second = chat_ids(reference, turn)
    generated = reference.encode(reply, add_special_tokens=False)
    assert len(generated) == 8
    computed = [*expected, *generated[:-1]]
    shared = common_prefix(computed, expected_second) // BLOCK * BLOCK
    assert shared > len(expected) // BLOCK * BLOCK  # the reply's tokens are hit too
    assert second["usage"]["prompt_tokens"] == len(expected_second)
    assert 0 < shared < len(expected_second) - BLOCK
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == shared


async def test_completion_text_detokenize_and_token_strs_are_the_tokenizers(
    sim: RunningEngine, reference: PreTrainedTokenizerBase
) -> None:
    text = "Café naïve — «quoted» 数据 " + text_for("c", 50)
    expected = reference.encode(text)
    async with aiohttp.ClientSession() as http:
        completion = await post(
            http, f"{sim.url}/v1/completions", {"prompt": text, "max_tokens": 1}
        )
        tokens = await post(
            http, f"{sim.url}/tokenize", {"prompt": text, "return_token_strs": True}
        )
        chat = await post(http, f"{sim.url}/tokenize", {"messages": MESSAGES})
        decoded = await post(http, f"{sim.url}/detokenize", {"tokens": chat["tokens"]})
        outside = await post(
            http, f"{sim.url}/detokenize", {"tokens": [len(reference) + 5]}, status=400
        )
        by_ids = await post(
            http, f"{sim.url}/v1/completions", {"prompt": expected, "max_tokens": 1}
        )
    assert completion["usage"]["prompt_tokens"] == len(expected)
    assert tokens["tokens"] == expected
    assert tokens["token_strs"] == reference.convert_ids_to_tokens(expected)
    assert decoded["prompt"] == reference.decode(chat["tokens"])
    assert decoded["prompt"].startswith("<|im_start|>system\n")
    assert "out of vocabulary" in outside["error"]["message"]
    # The same ids given as ids: the blocks the text left cached.
    assert by_ids["usage"]["prompt_tokens_details"]["cached_tokens"] == (
        (len(expected) - 1) // BLOCK * BLOCK
    )


async def test_template_options_render_as_transformers(
    sim: RunningEngine, reference: PreTrainedTokenizerBase
) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
    ]
    opened = [*MESSAGES, {"role": "assistant", "content": "The bug is in"}]
    async with aiohttp.ClientSession() as http:
        url = f"{sim.url}/tokenize"
        with_tools = await post(http, url, {"messages": MESSAGES, "tools": tools})
        thinking = await post(
            http,
            url,
            {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}},
        )
        continued = await post(
            http,
            url,
            {"messages": opened, "add_generation_prompt": False, "continue_final_message": True},
        )
        # The model's template reads tools: a completion with unusable ones is refused.
        refused = await post(
            http,
            f"{sim.url}/v1/chat/completions",
            {"messages": MESSAGES, "tools": ["read_file"], "max_tokens": 1},
            status=400,
        )
    assert with_tools["tokens"] == chat_ids(reference, MESSAGES, tools=tools)
    assert refused["error"]["param"] == "tools"
    assert thinking["tokens"] == chat_ids(reference, MESSAGES, enable_thinking=False)
    assert thinking["tokens"] != chat_ids(reference, MESSAGES)
    assert continued["tokens"] == chat_ids(
        reference, opened, add_generation_prompt=False, continue_final_message=True
    )


async def test_kv_events_carry_the_models_ids(
    model_dir: Path, reference: PreTrainedTokenizerBase
) -> None:
    port, replay = free_port(), free_port()
    events = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}"
    )
    expected = chat_ids(reference, MESSAGES)
    full = len(expected) // BLOCK * BLOCK
    config = engine_config(tokenizer=str(model_dir), kv_events=events)
    async with serve_engine_on("httptools", config) as sim, aiohttp.ClientSession() as http:
        body = {"model": TEST_MODEL, "messages": MESSAGES, "max_tokens": 1}
        await post(http, f"{sim.url}/v1/chat/completions", body)
        messages = await asyncio.to_thread(replay_from, replay, 0)
    stored = [
        e
        for m in messages
        for e in wire.decode_batch(m.payload).events
        if isinstance(e, wire.BlockStored)
    ]
    assert full >= 2 * BLOCK
    assert [t for e in stored for t in e.token_ids] == expected[:full]
