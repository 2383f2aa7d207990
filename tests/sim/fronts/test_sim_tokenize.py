"""The simulated engine's vLLM tokenizer endpoints (/tokenize, /detokenize, render) over
real loopback HTTP: the ids are the engine's own tokens, so they hit its cache."""

from __future__ import annotations

from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.textgen import text_for
from bench.tokenizer import GENERATION_PROMPT, IM_END, encode_piece, num_tokens, render_chat
from tests.conftest import TEST_MODEL, EngineFactory, RunningEngine
from tests.sim_servers import post

BLOCK = 16
MESSAGES = [
    {"role": "system", "content": text_for("sys", 300)},
    {"role": "user", "content": text_for("u1", 120)},
]


async def test_tokenize_chat_is_the_prompt_the_engine_computes(sim: RunningEngine) -> None:
    async with aiohttp.ClientSession() as http:
        tokens = await post(
            http, f"{sim.url}/tokenize", {"model": TEST_MODEL, "messages": MESSAGES}
        )
        body = {"model": TEST_MODEL, "messages": MESSAGES, "max_tokens": 1}
        completion = await post(http, f"{sim.url}/v1/chat/completions", body)
    assert set(tokens) == {"count", "max_model_len", "tokens", "token_strs"}
    assert tokens["count"] == len(tokens["tokens"]) == completion["usage"]["prompt_tokens"]
    assert tokens["max_model_len"] == sim.engine.max_model_len
    assert tokens["token_strs"] is None
    # A token id is the token's 4 bytes read as a little-endian uint32.
    assert tokens["tokens"][0] == int.from_bytes(b"<|im", "little")


async def test_tokenize_completion_and_token_strs(sim: RunningEngine) -> None:
    async with aiohttp.ClientSession() as http:
        tokens = await post(
            http, f"{sim.url}/tokenize", {"prompt": "once upon a time", "return_token_strs": True}
        )
    assert tokens["count"] == 4  # 16 bytes, no special tokens added
    assert tokens["tokens"] == [
        int.from_bytes(w.encode(), "little") for w in ("once", " upo", "n a ", "time")
    ]
    assert tokens["token_strs"] == ["once", " upo", "n a ", "time"]


async def test_generation_prompt_and_continue_final_message(sim: RunningEngine) -> None:
    turn = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    url = f"{sim.url}/tokenize"
    async with aiohttp.ClientSession() as http:
        full = await post(http, url, {"messages": turn})
        closed = await post(http, url, {"messages": turn, "add_generation_prompt": False})
        open_ = await post(
            http,
            url,
            {"messages": turn, "add_generation_prompt": False, "continue_final_message": True},
        )
        both = await post(
            http,
            url,
            {"messages": turn, "add_generation_prompt": True, "continue_final_message": True},
            status=400,
        )
    assert closed["count"] == full["count"] - num_tokens(GENERATION_PROMPT)
    assert closed["tokens"] == full["tokens"][: closed["count"]]
    assert open_["tokens"] == closed["tokens"][: -num_tokens(encode_piece(IM_END))]
    assert both["error"]["code"] == 400 and "continue_final_message" in both["error"]["message"]


async def test_detokenize_round_trips(sim: RunningEngine) -> None:
    prompt = "naïve café, 東京 — " + text_for("rt", 40)
    async with aiohttp.ClientSession() as http:
        tokens = await post(http, f"{sim.url}/tokenize", {"model": TEST_MODEL, "prompt": prompt})
        text = await post(
            http, f"{sim.url}/detokenize", {"model": TEST_MODEL, "tokens": tokens["tokens"]}
        )
        chat = await post(http, f"{sim.url}/tokenize", {"messages": MESSAGES})
        chat_text = await post(http, f"{sim.url}/detokenize", {"tokens": chat["tokens"]})
    assert text == {"prompt": prompt}
    # A chat detokenizes to its rendered template, padding dropped.
    rendered = render_chat(MESSAGES).replace(b"\xff", b"").decode()
    assert chat_text["prompt"] == rendered
    assert chat_text["prompt"].startswith("<|im_start|>system\n")


async def test_tokenized_ids_as_a_completion_prompt_hit_the_chat_cache(
    sim: RunningEngine,
) -> None:
    async with aiohttp.ClientSession() as http:
        body = {"model": TEST_MODEL, "messages": MESSAGES, "max_tokens": 1}
        first = await post(http, f"{sim.url}/v1/chat/completions", body)
        tokens = await post(http, f"{sim.url}/tokenize", {"messages": MESSAGES})
        completion = await post(
            http,
            f"{sim.url}/v1/completions",
            {"model": TEST_MODEL, "prompt": tokens["tokens"], "max_tokens": 1},
        )
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    prompt = completion["usage"]["prompt_tokens"]
    assert prompt == tokens["count"]
    assert (
        completion["usage"]["prompt_tokens_details"]["cached_tokens"]
        == ((prompt - 1) // BLOCK * BLOCK)
        > 0
    )


async def test_render_answers_generate_requests_without_running(sim: RunningEngine) -> None:
    chat_body = {
        "model": TEST_MODEL,
        "messages": MESSAGES,
        "max_tokens": 7,
        "continue_final_message": False,
        "separate_reasoning": True,
    }
    async with aiohttp.ClientSession() as http:
        tokens = await post(http, f"{sim.url}/tokenize", {"messages": MESSAGES})
        chat = await post(http, f"{sim.url}/v1/chat/completions/render", chat_body)
        completions = await post(
            http, f"{sim.url}/v1/completions/render", {"prompt": tokens["tokens"], "stream": True}
        )
        too_long = await post(
            http,
            f"{sim.url}/v1/chat/completions/render",
            {**chat_body, "max_tokens": 10_000_000},
            status=400,
        )
        async with http.get(f"{sim.url}/metrics") as response:
            families = text_string_to_metric_families(await response.text())
            computed = {s.name: s.value for f in families for s in f.samples}
    assert chat["token_ids"] == tokens["tokens"]
    assert chat["request_id"].startswith("chatcmpl-") and chat["model"] == TEST_MODEL
    assert chat["sampling_params"]["max_tokens"] == 7 and chat["features"] is None
    assert isinstance(completions, list) and len(completions) == 1
    assert completions[0]["token_ids"] == tokens["tokens"]
    assert completions[0]["request_id"].startswith("cmpl-") and completions[0]["model"] is None
    assert completions[0]["stream"] is True
    assert completions[0]["sampling_params"]["max_tokens"] == (
        sim.engine.max_model_len - tokens["count"]
    )
    assert too_long["error"]["code"] == 400
    # Rendering and tokenizing computed nothing.
    assert computed["vllm:prompt_tokens_total"] == 0


async def test_bad_tokenizer_bodies_get_vllm_errors(sim: RunningEngine) -> None:
    messages = [{"role": "user", "content": "x"}]
    cases: list[tuple[str, Any, int]] = [
        ("/tokenize", b"{not json", 400),
        ("/tokenize", [1, 2], 400),
        ("/tokenize", {"model": TEST_MODEL}, 400),
        ("/tokenize", {"prompt": [1, 2, 3]}, 400),
        ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, 400),
        ("/tokenize", {"messages": "hi"}, 400),
        ("/tokenize", {"messages": [{"content": "no role"}]}, 400),
        ("/tokenize", {"messages": messages, "add_generation_prompt": "no"}, 400),
        ("/tokenize", {"messages": messages, "chat_template": "{{ messages }}"}, 400),
        ("/tokenize", {"messages": messages, "tools": "all"}, 400),
        ("/tokenize", {"model": "other", "prompt": "x"}, 404),
        ("/detokenize", {"model": TEST_MODEL}, 400),
        ("/detokenize", {"tokens": ["a"]}, 400),
        ("/detokenize", {"tokens": [-1]}, 400),
        ("/detokenize", {"tokens": [2**32]}, 400),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404),
        ("/v1/chat/completions/render", {"messages": "hi"}, 400),
        ("/v1/completions/render", {"model": "other", "prompt": "x"}, 404),
    ]
    async with aiohttp.ClientSession() as http:
        for path, body, status in cases:
            error = (await post(http, f"{sim.url}{path}", body, status=status))["error"]
            assert set(error) == {"message", "type", "param", "code"}, (path, body)
            assert error["code"] == status and error["message"], (path, body)
            if status == 404:
                assert error["type"] == "NotFoundError"
                assert error["message"] == (
                    "The model `other` does not exist. Valid aliases: sim-model."
                )
        # The endpoints still serve after all of that.
        assert (await post(http, f"{sim.url}/detokenize", {"tokens": []})) == {"prompt": ""}


async def test_sglang_flavor_has_no_vllm_tokenizer_endpoints(
    engine_factory: EngineFactory,
) -> None:
    async with engine_factory(flavor="sglang") as sim, aiohttp.ClientSession() as http:
        for path in ("/tokenize", "/detokenize", "/v1/chat/completions/render"):
            async with http.post(f"{sim.url}{path}", json={"prompt": "x"}) as response:
                assert response.status == 404, path
