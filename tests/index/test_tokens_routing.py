"""The router keyed by the model's own tokens (``prefix.tokenizer``), end to end: real
HTTP through the router to simulated engines, the prompts' ids checked against
transformers' ``apply_chat_template`` (what vLLM encodes chat prompts with)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from transformers import AutoTokenizer

from bench.textgen import text_for
from router.cli import build_parser
from router.cli.serve import flag_overrides
from router.config import PrefixConfig, WorkerConfig
from router.errors import ConfigError
from router.index.prefix import chain_seed, prefix_key
from router.tokens.engine import token_ids_of
from router.wire.blocks import token_bytes
from tests.conftest import TEST_MODEL, EngineFactory, RunningRouter, router_config, serve_router
from tests.router_client import (
    WORKER,
    chat_body,
    conversation,
    engines,
    fake_engine,
    metric,
    post,
    whole_reply,
)

ENGINE_BLOCK = 16  # tokens; the router's blocks are the engine's
BLOCK_BYTES = 4 * ENGINE_BLOCK


def tokens_config(fleet: Any, model_dir: Path) -> Any:
    return router_config(
        fleet, prefix=PrefixConfig(block_bytes=BLOCK_BYTES, tokenizer=str(model_dir))
    )


def resident_tokens(router: RunningRouter, worker: str) -> int:
    state = router.state
    return state.router.index.resident_blocks(worker) * state.router.block_tokens


async def test_a_session_is_keyed_by_the_engines_tokens(
    engine_factory: EngineFactory, model_dir: Path
) -> None:
    reference = AutoTokenizer.from_pretrained(str(model_dir))
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(tokens_config(fleet, model_dir)) as router,
        aiohttp.ClientSession() as http,
    ):
        messages = conversation("tok", 300, 120)
        workers = []
        for turn in range(4):
            result = await post(http, router.url, chat_body(messages, max_tokens=16))
            assert result.status == 200, result.raw
            assert result.worker is not None
            workers.append(result.worker)
            if turn == 0:
                ids = reference.apply_chat_template(
                    messages, tokenize=True, add_generation_prompt=True, return_dict=False
                )
                # The whole blocks of real tokens of the prompt and of the reply's text
                # as the next turn carries it, no more, no fewer.
                reply = reference.encode(result.text, add_special_tokens=False)
                held = (len(ids) + len(reply)) // 16 * 16
                assert held > len(ids) // 16 * 16
                assert resident_tokens(router, result.worker) == held
            else:
                assert result.cached > 0
            messages += [
                {"role": "assistant", "content": result.text},
                {"role": "user", "content": text_for(f"tok-u{turn + 1}", 80)},
            ]
        assert len(set(workers)) == 1, workers
        tokenized = await metric(
            http, router, "kvrouter_prefix_tokenized_requests_total", result="tokens"
        )
        assert tokenized == 4
        # From the second turn on, the previous prompt's ids were reused.
        assert await metric(http, router, "kvrouter_prefix_reused_tokens_total") > 0


async def test_what_the_router_cannot_render_is_keyed_by_its_text_and_served(
    engine_factory: EngineFactory, model_dir: Path
) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(tokens_config(fleet, model_dir)) as router,
        aiohttp.ClientSession() as http,
    ):
        cases = [
            # rendered by cutting the template's output: not done by the router
            chat_body(
                [*conversation("c", 50, 20), {"role": "assistant", "content": "Once"}],
                continue_final_message=True,
                add_generation_prompt=False,
            ),
            # tools the template cannot be given
            chat_body(conversation("t", 50, 20), tools=["read_file"]),
            chat_body(conversation("k", 50, 20), chat_template_kwargs="not an object"),
        ]
        for body in cases:
            result = await post(http, router.url, body)
            assert result.status == 200, result.raw
        assert await metric(
            http, router, "kvrouter_prefix_tokenized_requests_total", result="text"
        ) == len(cases)


async def test_a_tokenizer_directory_that_is_not_one_fails_at_start(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    async with engines(engine_factory, 1) as fleet:
        with pytest.raises(ConfigError, match="no tokenizer"):
            async with serve_router(tokens_config(fleet, tmp_path)):
                pass


def test_token_blocks_must_be_whole_tokens() -> None:
    with pytest.raises(ConfigError, match="whole number of tokens"):
        PrefixConfig(block_bytes=66, tokenizer="/models/qwen3")


def test_kvrouter_serve_takes_the_tokenizer_as_a_flag() -> None:
    args = build_parser().parse_args(
        ["serve", "--worker", "http://e0", "--tokenizer", "/models/qwen3", "--block-bytes", "64"]
    )
    assert flag_overrides(args)["prefix"] == {"block_bytes": 64, "tokenizer": "/models/qwen3"}


async def test_a_completion_is_keyed_by_the_engines_tokens_too(
    engine_factory: EngineFactory, model_dir: Path
) -> None:
    reference = AutoTokenizer.from_pretrained(str(model_dir))
    text = text_for("completion", 200)
    ids = [7 + i for i in range(40)]  # two whole blocks and a part
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(tokens_config(fleet, model_dir)) as router,
        aiohttp.ClientSession() as http,
    ):
        index = router.state.router.index
        for prompt, expected in ((text, reference(text)["input_ids"]), (ids, ids)):
            body = {"model": TEST_MODEL, "prompt": prompt, "max_tokens": 1}
            async with http.post(router.url + "/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                worker = response.headers[WORKER]
            key = prefix_key(token_bytes(expected), BLOCK_BYTES, chain_seed(TEST_MODEL))
            assert len(key.hashes) >= 2
            # Blocks the engine announces for these ids are the very ones held.
            assert index.match(worker, key.hashes) == len(key.hashes)
        assert (
            await metric(http, router, "kvrouter_prefix_tokenized_requests_total", result="tokens")
            == 2
        )


async def test_a_worker_that_cannot_tokenize_costs_only_the_key() -> None:
    async def chat(request: web.Request) -> web.Response:
        return whole_reply()

    async with fake_engine(chat) as url, aiohttp.ClientSession() as http:
        config = router_config(
            [],
            workers=(WorkerConfig(url, name="w0"),),
            prefix=PrefixConfig(block_bytes=64, tokenizer="engine"),
        )
        async with serve_router(config) as router:
            body = chat_body(conversation("no-tokenize", 50, 20), stream=False)
            result = await post(http, router.url, body)
            assert result.status == 200, result.raw
            # The stand-in has no /tokenize (a 404): keyed by its text, served all the same.
            assert (
                await metric(
                    http, router, "kvrouter_prefix_tokenized_requests_total", result="text"
                )
                == 1
            )


def test_only_a_list_of_token_ids_is_taken_from_a_workers_answer() -> None:
    assert token_ids_of(b'{"count": 3, "tokens": [1, 2, 3]}') == [1, 2, 3]
    for answer in (
        b"not json",
        b"[1, 2]",
        b'{"tokens": []}',
        b'{"tokens": [1, true]}',
        b'{"tokens": [1, -2]}',
        b'{"tokens": [1, 4294967296]}',
        b'{"tokens": "1 2"}',
    ):
        assert token_ids_of(answer) is None, answer
