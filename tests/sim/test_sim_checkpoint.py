"""Checkpoint and restore of the simulated engine (``bench/sim/checkpoint.py``), over real
loopback HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from bench.ports import free_port
from bench.sim import checkpoint
from bench.sim.kv_events import KVEventsConfig
from bench.textgen import text_for
from router.cli import main as cli_main
from router.index import events as wire
from tests.conftest import TEST_MODEL, EngineFactory, RunningEngine, engine_config
from tests.sim.test_sim_kv_events import replay_from

TURNS = 3


async def post(
    http: aiohttp.ClientSession, url: str, path: str, body: Any
) -> tuple[int, dict[str, Any]]:
    async with http.post(f"{url}{path}", json=body) as response:
        return response.status, await response.json(content_type=None)


async def turn(
    http: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, str]],
    model: str = TEST_MODEL,
) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "max_tokens": 40, "seed": 7}
    status, answer = await post(http, url, "/v1/chat/completions", body)
    assert status == 200, answer
    return answer


def cached(answer: dict[str, Any]) -> int:
    tokens: int = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return tokens


async def conversation(http: aiohttp.ClientSession, url: str) -> list[dict[str, str]]:
    """A few turns on the engine at ``url``; returns the messages of the next turn."""
    messages: list[dict[str, str]] = [{"role": "system", "content": text_for("system", 300)}]
    for i in range(TURNS):
        messages.append({"role": "user", "content": text_for(f"user{i}", 120)})
        answer = await turn(http, url, messages)
        messages.append(
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
        )
        # Other sessions' traffic, so that the LRU order matters.
        await turn(http, url, [{"role": "user", "content": text_for(f"other{i}", 200)}])
    messages.append({"role": "user", "content": text_for("next", 120)})
    return messages


async def start_time(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    line = next(x for x in text.splitlines() if x.startswith("process_start_time_seconds "))
    return float(line.split()[1])


def cache_of(sim: RunningEngine) -> list[int]:
    return sim.engine.pool.eviction_order([])


async def test_a_restored_engine_hits_the_next_turn_as_the_original_would(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    path = str(tmp_path / "a.ckpt")
    # Small enough that the conversation and the other sessions evict each other.
    async with engine_factory(kv_tokens=2048) as a, aiohttp.ClientSession() as http:
        messages = await conversation(http, a.url)
        status, written = await post(http, a.url, "/sim/checkpoint", {"path": path})
        assert status == 200, written
        size = (await asyncio.to_thread(Path(path).stat)).st_size
        assert written["path"] == path and written["bytes"] == size
        assert written["blocks"] == a.engine.num_blocks and written["cached_blocks"] > 0
        async with engine_factory(kv_tokens=2048) as b:
            started = await start_time(http, b.url)
            await asyncio.sleep(0.01)
            status, restored = await post(http, b.url, "/sim/restore", {"path": path})
            assert status == 200, restored
            assert cache_of(b) == cache_of(a)
            assert await start_time(http, b.url) > started
            assert restored["process_start_time_seconds"] == await start_time(http, b.url)
            on_b = await turn(http, b.url, messages)
        async with engine_factory(kv_tokens=2048, restore=path) as c:
            assert cache_of(c) == cache_of(a)
            on_c = await turn(http, c.url, messages)
        on_a = await turn(http, a.url, messages)
    assert cached(on_a) > 0
    assert cached(on_b) == cached(on_c) == cached(on_a)
    # The same draws too: the restored engine answers as the original would have.
    assert on_b["choices"][0]["message"] == on_a["choices"][0]["message"]


async def test_a_checkpoint_of_another_engine_is_refused_and_the_cache_kept(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    path = str(tmp_path / "a.ckpt")
    async with engine_factory(kv_tokens=4096) as a, aiohttp.ClientSession() as http:
        await conversation(http, a.url)
        status, _ = await post(http, a.url, "/sim/checkpoint", {"path": path})
        assert status == 200
    others: list[tuple[dict[str, Any], str]] = [
        ({"kv_tokens": 8192}, "num_blocks"),
        ({"block_tokens": 32, "kv_tokens": 4096}, "block_tokens"),
        ({"served_model_name": "other-model", "kv_tokens": 4096}, "model"),
        ({"prefix_caching_hash_algo": "xxhash", "kv_tokens": 4096}, "hash_algo"),
    ]
    for overrides, field in others:
        async with engine_factory(**overrides) as b, aiohttp.ClientSession() as http:
            mine = [{"role": "user", "content": text_for("mine", 100)}]
            await turn(http, b.url, mine, b.config.served_model_name)
            before, started = cache_of(b), await start_time(http, b.url)
            status, answer = await post(http, b.url, "/sim/restore", {"path": path})
            assert status == 409, answer
            assert field in answer["error"]["message"]
            assert cache_of(b) == before and await start_time(http, b.url) == started
        with pytest.raises(checkpoint.CheckpointMismatch, match=field):
            async with engine_factory(restore=path, **overrides):
                pass


async def test_a_restore_is_refused_while_requests_run(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    path = str(tmp_path / "a.ckpt")
    async with engine_factory() as a, aiohttp.ClientSession() as http:
        await turn(http, a.url, [{"role": "user", "content": text_for("first", 100)}])
        long = {
            "model": TEST_MODEL,
            "prompt": text_for("long", 100),
            "max_tokens": 5000,
            "ignore_eos": True,
            "stream": True,
        }
        streaming = await http.post(f"{a.url}/v1/completions", json=long)
        await streaming.content.readline()  # the first token: it runs
        # A checkpoint while a request runs keeps its full blocks, as free ones.
        status, _ = await post(http, a.url, "/sim/checkpoint", {"path": path})
        assert status == 200
        before = a.engine.pool.eviction_order([r.blocks for r in a.engine.scheduler.running])
        status, answer = await post(http, a.url, "/sim/restore", {"path": path})
        assert status == 409 and "running" in answer["error"]["message"]
        assert a.engine.scheduler.running
        after = a.engine.pool.eviction_order([r.blocks for r in a.engine.scheduler.running])
        assert after == before
        streaming.close()
    assert checkpoint.read(path).cached_blocks > 0


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"not a checkpoint at all", "not a simulated engine checkpoint"),
        (msgspec.msgpack.encode({"format": "other", "version": 1}), "not a simulated engine"),
        (msgspec.msgpack.encode({"format": checkpoint.FORMAT, "version": 99}), "version 99"),
        (msgspec.msgpack.encode({"format": checkpoint.FORMAT, "version": 1}), "damaged"),
    ],
)
async def test_a_file_that_is_not_a_checkpoint_is_a_clear_error(
    engine_factory: EngineFactory, tmp_path: Path, content: bytes, words: str
) -> None:
    path = tmp_path / "bad.ckpt"
    path.write_bytes(content)
    async with engine_factory() as sim, aiohttp.ClientSession() as http:
        status, answer = await post(http, sim.url, "/sim/restore", {"path": str(path)})
        assert status == 400 and words in answer["error"]["message"]
        status, answer = await post(http, sim.url, "/sim/restore", {"path": str(path) + ".no"})
        assert status == 400 and "cannot read" in answer["error"]["message"]
        status, answer = await post(http, sim.url, "/sim/checkpoint", {"nothing": 1})
        assert status == 400


async def test_a_restored_engine_announces_its_blocks_as_the_original_named_them(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    path = str(tmp_path / "a.ckpt")

    def events_config() -> tuple[KVEventsConfig, int]:
        port, replay = free_port(), free_port()
        return KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"tcp://*:{port}",
            replay_endpoint=f"tcp://*:{replay}",
        ), replay

    config_a, replay_a = events_config()
    config_b, replay_b = events_config()
    async with engine_factory(kv_events=config_a) as a, aiohttp.ClientSession() as http:
        await conversation(http, a.url)
        status, _ = await post(http, a.url, "/sim/checkpoint", {"path": path})
        assert status == 200
        original = await asyncio.to_thread(replay_from, replay_a, 0)
        async with engine_factory(kv_events=config_b, restore=path):
            restored = await asyncio.to_thread(replay_from, replay_b, 0)
    stored_a: dict[Any, Any] = {}  # each block the original announced -> its parent
    for message in original:
        for e in wire.decode_batch(message.payload).events:
            if isinstance(e, wire.BlockStored):
                parent = e.parent_block_hash
                for h in e.block_hashes:
                    stored_a[h], parent = parent, h
    events = [e for m in restored for e in wire.decode_batch(m.payload).events]
    assert isinstance(events[0], wire.AllBlocksCleared)
    stored_b = [e for e in events[1:] if isinstance(e, wire.BlockStored)]
    assert len(stored_b) == len(events) - 1 == checkpoint.read(path).cached_blocks
    seen: set[Any] = set()
    for event in stored_b:
        (block,) = event.block_hashes
        # Named as the original named it, under the same parent, announced after it.
        assert stored_a[block] == event.parent_block_hash
        assert event.parent_block_hash is None or event.parent_block_hash in seen
        seen.add(block)


def test_the_cli_refuses_to_start_from_another_engines_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "a.ckpt"
    config = engine_config(kv_tokens=4096)
    from bench.sim.engine import Engine

    engine = Engine(config)
    checkpoint.write(str(path), checkpoint.take(engine))
    args = ["sim", "engine", "--model", "llama-3.1-8b", "--served-model-name", TEST_MODEL]
    code = cli_main([*args, "--kv-tokens", "8192", "--restore", str(path)])
    assert code == 2
    assert "num_blocks 512 != 256" in capsys.readouterr().out
    path.write_bytes(b"junk")
    assert cli_main([*args, "--kv-tokens", "4096", "--restore", str(path)]) == 2
    assert "not a simulated engine checkpoint" in capsys.readouterr().out
    assert dataclasses.replace(config, restore=str(path)).restore == str(path)
