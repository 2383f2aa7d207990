"""The simulated engine over real loopback HTTP, read with aiohttp and the OpenAI client."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.textgen import text_for
from bench.tokenizer import encode_piece
from tests.conftest import TEST_MODEL, EngineFactory, RunningEngine

BLOCK = 16


async def chat(
    http: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, Any]],
    max_tokens: int = 8,
    **extra: Any,
) -> dict[str, Any]:
    body = {
        "model": TEST_MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }
    async with http.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        result: dict[str, Any] = await response.json()
        return result


async def metric_values(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.labels.get("le") is None
    }


async def test_repeated_and_extended_prompts_report_cached_tokens(sim: RunningEngine) -> None:
    messages = [
        {"role": "system", "content": text_for("sys", 300)},
        {"role": "user", "content": text_for("u1", 200)},
    ]
    async with aiohttp.ClientSession() as http:
        first = await chat(http, sim.url, messages, max_tokens=20)
        again = await chat(http, sim.url, messages, max_tokens=20)
        reply = first["choices"][0]["message"]["content"]
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": text_for("u2", 100)},
        ]
        extended = await chat(http, sim.url, messages, max_tokens=20)
    prompt = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // BLOCK * BLOCK
    # Everything the first turn computed (prompt + reply - 1 tokens) is hit in full blocks.
    computed = prompt + 20 - 1
    assert extended["usage"]["prompt_tokens_details"]["cached_tokens"] == computed // BLOCK * BLOCK
    assert extended["usage"]["prompt_tokens"] > computed


async def test_lru_evicts_the_session_idle_longest(engine_factory: EngineFactory) -> None:
    async with engine_factory(kv_tokens=1024) as sim, aiohttp.ClientSession() as http:
        sessions = {k: [{"role": "user", "content": text_for(k, 300)}] for k in "abcd"}
        for key in "abc":
            await chat(http, sim.url, sessions[key], max_tokens=1)
        await chat(http, sim.url, sessions["a"], max_tokens=1)  # a is used again
        await chat(http, sim.url, sessions["d"], max_tokens=1)  # pressure
        cached = {}
        for key in "cab":
            result = await chat(http, sim.url, sessions[key], max_tokens=1)
            cached[key] = result["usage"]["prompt_tokens_details"]["cached_tokens"]
    full = (result["usage"]["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert cached["c"] == full and cached["a"] == full
    assert cached["b"] < full


async def test_openai_client_streams_chat_and_completions(sim: RunningEngine) -> None:
    client = openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model=TEST_MODEL,
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        assert usage is not None and usage.completion_tokens == 12
        assert usage.prompt_tokens_details is not None
        assert len(text) == 12 * 4 and finish == "length"

        completion = await client.completions.create(
            model=TEST_MODEL,
            prompt="once upon a time",
            max_tokens=5,
            extra_body={"ignore_eos": True},
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 5
        assert len(completion.choices[0].text) == 20

        models = await client.models.list()
        assert [m.id for m in models.data] == [TEST_MODEL]
    finally:
        await client.close()


async def test_metrics_carry_vllm_names_and_match_usage(sim: RunningEngine) -> None:
    async with aiohttp.ClientSession() as http:
        messages = [{"role": "user", "content": text_for("m", 200)}]
        results = [await chat(http, sim.url, messages, max_tokens=10) for _ in range(3)]
        values = await metric_values(http, sim.url)
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)
    assert values["vllm:prefix_cache_queries_total"] == prompt
    assert values["vllm:prefix_cache_hits_total"] == cached > 0
    assert values["vllm:prompt_tokens_total"] == prompt
    assert values["vllm:generation_tokens_total"] == 30
    assert values["vllm:time_to_first_token_seconds_count"] == 3
    assert values["vllm:num_requests_running"] == 0
    assert values["vllm:cache_config_info"] == 1
    assert values["process_start_time_seconds"] > 0


async def test_bad_input_gets_openai_errors(sim: RunningEngine) -> None:
    cases: list[tuple[Any, int]] = [
        (b"{not json", 400),
        ({"model": TEST_MODEL}, 400),
        ({"model": TEST_MODEL, "messages": "hi"}, 400),
        ({"model": TEST_MODEL, "messages": [{"content": "no role"}]}, 400),
        (
            {
                "model": TEST_MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": "ten",
            },
            400,
        ),
        (
            {
                "model": TEST_MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 10_000_000,
            },
            400,
        ),
        ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404),
        ([1, 2, 3], 400),
    ]
    async with aiohttp.ClientSession() as http:
        for body, status in cases:
            data = body if isinstance(body, bytes) else None
            json_body = None if isinstance(body, bytes) else body
            async with http.post(
                f"{sim.url}/v1/chat/completions", data=data, json=json_body
            ) as response:
                assert response.status == status, (body, await response.text())
                error = (await response.json())["error"]
                assert error["code"] == status and error["message"]
        # The engine still serves after all of that.
        await chat(http, sim.url, [{"role": "user", "content": "ok"}])


async def test_faults_fail_stall_and_restart(sim: RunningEngine) -> None:
    messages = [{"role": "user", "content": text_for("f", 100)}]
    async with aiohttp.ClientSession() as http:
        await chat(http, sim.url, messages)
        async with http.post(f"{sim.url}/sim/faults", json={"fail_requests": True}) as r:
            assert r.status == 200
        async with http.post(
            f"{sim.url}/v1/chat/completions", json={"model": TEST_MODEL, "messages": messages}
        ) as r:
            assert r.status == 500
        await http.post(f"{sim.url}/sim/faults", json={"fail_requests": False, "stall": True})
        pending = asyncio.create_task(chat(http, sim.url, messages))
        await asyncio.sleep(0.3)
        assert not pending.done(), "a stalled engine answered"
        await http.post(f"{sim.url}/sim/faults", json={"stall": False})
        hit = await asyncio.wait_for(pending, 10)
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

        before = (await metric_values(http, sim.url))["process_start_time_seconds"]
        await asyncio.sleep(0.01)
        async with http.post(f"{sim.url}/sim/restart") as r:
            assert r.status == 200
        after = await metric_values(http, sim.url)
        assert after["process_start_time_seconds"] > before
        assert after["vllm:prefix_cache_hits_total"] == 0
        cold = await chat(http, sim.url, messages)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        async with http.post(f"{sim.url}/sim/faults", json={"explode": True}) as r:
            assert r.status == 400


async def test_restart_drops_requests_in_flight(sim: RunningEngine) -> None:
    async with aiohttp.ClientSession() as http:
        pending = asyncio.create_task(
            chat(http, sim.url, [{"role": "user", "content": "long"}], max_tokens=5000)
        )
        await asyncio.sleep(0.2)
        await http.post(f"{sim.url}/sim/restart")
        try:
            await asyncio.wait_for(pending, 5)
        except (aiohttp.ClientError, AssertionError):
            pass
        else:
            raise AssertionError("a request in flight survived a restart")
    assert not sim.engine.scheduler.has_work


async def test_client_disconnect_frees_the_engine(sim: RunningEngine) -> None:
    async with aiohttp.ClientSession() as http:
        body = {
            "model": TEST_MODEL,
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 20_000,
            "ignore_eos": True,
            "stream": True,
        }
        async with http.post(f"{sim.url}/v1/chat/completions", json=body) as response:
            await response.content.readline()
            assert sim.engine.scheduler.running
    for _ in range(100):
        if not sim.engine.scheduler.has_work:
            break
        await asyncio.sleep(0.02)
    assert not sim.engine.scheduler.has_work
    assert sim.engine.pool.usage() == 0.0


async def test_sglang_flavor_endpoints(engine_factory: EngineFactory) -> None:
    async with engine_factory(flavor="sglang") as sim, aiohttp.ClientSession() as http:
        for path in ("/model_info", "/server_info", "/health_generate", "/health", "/version"):
            async with http.get(f"{sim.url}{path}") as response:
                assert response.status == 200, path
        async with http.get(f"{sim.url}/server_info") as response:
            info = await response.json()
        assert info["max_total_num_tokens"] == 50_000 // BLOCK * BLOCK
        await chat(http, sim.url, [{"role": "user", "content": "x"}])
        async with http.get(f"{sim.url}/metrics") as response:
            names = {f.name for f in text_string_to_metric_families(await response.text())}
        assert any(n.startswith("sglang:") for n in names)
        assert not any(n.startswith("vllm:") for n in names)


async def test_engine_timings_follow_the_roofline(engine_factory: EngineFactory) -> None:
    """Alone on an engine, a request's first token comes one prefill step after it was
    scheduled and every later token one decode step (of a growing context) after the
    previous, exactly as the roofline says, though decoded as spans."""
    async with engine_factory(time_scale=20.0) as sim:
        engine = sim.engine
        request = engine.submit(encode_piece(text_for("roofline", 3000)), 300, True)
        wakes = 0
        while not request.finished:
            await request.updated.wait()
            request.updated.clear()
            wakes += 1
        assert request.scheduled_at is not None and request.first_token_at is not None
        prefill = engine.roofline.step_seconds([(3000, 0)])
        assert request.first_token_at - request.scheduled_at == pytest.approx(prefill, rel=1e-9)
        gaps = [b - a for a, b in itertools.pairwise(request.token_times)]
        assert gaps == pytest.approx(engine.roofline.decode_step_seconds(1, 3000, 299), rel=1e-9)
        assert request.output_tokens == 300
        assert wakes < 100  # tokens were handed to the stream coalesced, not one by one


async def test_an_api_key_guards_the_v1_routes_as_vllms_does(
    engine_factory: EngineFactory,
) -> None:
    async with engine_factory(api_key="k3y") as sim, aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k3y"}):
            async with http.get(sim.url + "/v1/models", headers=headers) as response:
                assert response.status == 401
                assert await response.json() == {"error": "Unauthorized"}
        async with http.get(
            sim.url + "/v1/models", headers={"Authorization": "bearer k3y"}
        ) as response:
            assert response.status == 200
        for open_path in ("/health", "/metrics"):
            async with http.get(sim.url + open_path) as response:
                assert response.status == 200, open_path
        async with openai.AsyncOpenAI(
            base_url=sim.url + "/v1", api_key="k3y", max_retries=0
        ) as client:
            reply = await client.chat.completions.create(
                model=TEST_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert reply.usage is not None and reply.usage.completion_tokens == 2
        async with openai.AsyncOpenAI(
            base_url=sim.url + "/v1", api_key="no", max_retries=0
        ) as refused:
            with pytest.raises(openai.AuthenticationError):
                await refused.models.list()


async def test_tool_calls_need_a_parser_as_in_vllm(engine_factory: EngineFactory) -> None:
    """Without ``--tool-call-parser`` vLLM 0.32 refuses any tool_choice but "none" (by
    default "auto" once tools are offered) with these words; with one, a required call is
    answered and counted in ``vllm:tool_call_parser_invocations_total``."""
    tools = [{"type": "function", "function": {"name": "run", "parameters": {}}}]
    messages = [{"role": "user", "content": "ls"}]
    refused = {
        "required": 'tool_choice="required" requires --tool-call-parser to be set',
        None: '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
        "to be set",
    }
    async with engine_factory(tool_call_parser=None) as bare, aiohttp.ClientSession() as http:
        for choice, message in refused.items():
            body: dict[str, Any] = {"model": TEST_MODEL, "messages": messages, "tools": tools}
            if choice is not None:
                body["tool_choice"] = choice
            async with http.post(f"{bare.url}/v1/chat/completions", json=body) as response:
                assert response.status == 400
                assert (await response.json())["error"]["message"] == message
        plain = await chat(http, bare.url, messages, tools=tools, tool_choice="none")
        assert plain["choices"][0]["message"]["content"]
        async with http.get(f"{bare.url}/metrics") as response:
            assert "tool_call_parser" not in await response.text()
    async with engine_factory() as agents, aiohttp.ClientSession() as http:
        body = {"model": TEST_MODEL, "messages": messages, "tools": tools, "max_tokens": 1000}
        url = f"{agents.url}/v1/chat/completions"
        async with http.post(url, json=body | {"tool_choice": "required", "seed": 1}) as response:
            called = (await response.json())["choices"][0]
        assert called["finish_reason"] == "tool_calls" and called["message"]["tool_calls"]
        await chat(http, agents.url, messages, tools=tools, tool_choice="required")  # cut
        async with http.get(f"{agents.url}/metrics") as response:
            samples = {
                (s.labels["mode"], s.labels["outcome"], s.labels["request_type"]): s.value
                for family in text_string_to_metric_families(await response.text())
                for s in family.samples
                if s.name == "vllm:tool_call_parser_invocations_total"
            }
    assert len(samples) == 12 and sum(samples.values()) == 2
    for outcome in ("tool_call", "no_tool_call"):
        assert samples[("non_streaming", outcome, "chat_completions")] == 1
