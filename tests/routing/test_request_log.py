"""One JSON line per request, with the decision and its result, and nothing sensitive."""

from __future__ import annotations

import logging

import aiohttp
import orjson
import pytest

from tests.conftest import EngineFactory, router_config, serve_router
from tests.router_client import chat_body, engines, post


async def test_a_line_per_request_without_prompts_keys_or_headers(
    engine_factory: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvrouter.requests")
    secret_prompt = "SECRET-PROMPT-" * 50
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, log_requests=True)) as router,
        aiohttp.ClientSession(headers={"Authorization": "Bearer sk-secret"}) as http,
    ):
        messages = [{"role": "user", "content": secret_prompt}]
        for _ in range(2):
            result = await post(
                http, router.url, chat_body(messages, max_tokens=4, user="alice@example.com")
            )
            assert result.status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "kvrouter.requests"]
    assert len(lines) == 2
    for line in lines:
        assert "SECRET" not in line and "sk-secret" not in line and "alice" not in line
    first, second = (orjson.loads(line) for line in lines)
    assert first["worker"] == second["worker"] == "w0"
    assert first["outcome"] == "success" and first["attempt"] == 1
    assert first["session"] == second["session"] is not None
    assert first["engine_cached_tokens"] == 0 and second["engine_cached_tokens"] > 0
    assert second["predicted_cached_tokens"] > 0 and second["ttft_s"] > 0
