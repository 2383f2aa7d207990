"""The simulated engine held to the real one: the same requests to a real vLLM engine
(``tests/vllm_engines.py``) and to the simulator serving the same model files with the
same block size and tokenizer, compared by what a client or the router can observe —
the JSON shapes of replies, stream chunks, usage and errors, status codes, headers,
metric names and label sets.

Values that are not protocol (ids, timestamps, sampled text, timings) are compared by
type only. Every difference left on purpose is in ``KNOWN_DIFFERENCES`` with the reason,
and ``docs/engines/sim-vs-vllm.md`` lists the same; a difference that appears, or one that
is no longer there, fails the test."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import orjson
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from bench.sim.config import EngineConfig
from bench.sim.kv_events import KVEventsConfig
from bench.textgen import text_for
from bench.workloads.api_bodies import AGENT_TOOLS
from router.planning.capacity import gpu, load_model
from tests.conftest import RunningEngine, serve_engine
from tests.vllm_engines import (
    BLOCK_TOKENS,
    MAX_MODEL_LEN,
    MODEL_NAME,
    NUM_BLOCKS,
    QWEN3_TINY,
    VllmEngine,
    free_ports,
)

pytestmark = pytest.mark.timeout(300)

Shape = Any


def shape(value: Any) -> Shape:
    """The skeleton of a JSON value: objects by key, lists by their items' shapes, and
    scalars by type."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        shapes: list[Shape] = []
        for item in value:
            if shape(item) not in shapes:
                shapes.append(shape(item))
        return shapes
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return "str"


def differences(real: Shape, sim: Shape, path: str = "") -> list[str]:
    """Where two shapes differ, as paths: ``+x`` only real has it, ``-x`` only the
    simulator, ``x: a != b`` both but of other shapes."""
    if isinstance(real, dict) and isinstance(sim, dict):
        found = []
        for key in real.keys() | sim.keys():
            where = f"{path}.{key}" if path else key
            if key not in sim:
                found.append(f"+{where}")
            elif key not in real:
                found.append(f"-{where}")
            else:
                found += differences(real[key], sim[key], where)
        return found
    if isinstance(real, list) and isinstance(sim, list) and len(real) == len(sim) == 1:
        return differences(real[0], sim[0], f"{path}[]")
    if real != sim:
        return [f"{path}: {real} != {sim}"]
    return []


@dataclasses.dataclass(frozen=True, slots=True)
class Observed:
    status: int
    content_type: str
    body: Shape  # a whole reply's shape, or each distinct event's of a stream
    error: Any = None  # an error reply's body, compared word for word


async def observe(http: aiohttp.ClientSession, url: str, path: str, body: Any) -> Observed:
    async with http.post(url + path, data=orjson.dumps(body), headers=JSON) as response:
        raw = await response.read()
        content_type = response.headers.get("Content-Type", "")
    if content_type.startswith("text/event-stream"):
        return Observed(response.status, content_type, event_shapes(raw))
    reply = orjson.loads(raw)
    error = reply if response.status >= 400 else None
    return Observed(response.status, content_type, shape(reply), error)


def event_shapes(raw: bytes) -> dict[str, list[Shape]]:
    """A stream's events by kind (their ``type``, or the kind of chunk), each kind's
    distinct shapes in order."""
    kinds: dict[str, list[Shape]] = {}
    for event in raw.split(b"\n\n"):
        data = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
        if not data:
            continue
        if data[0] == b"[DONE]":
            kinds["[DONE]"] = ["[DONE]"]
            continue
        chunk = orjson.loads(data[0])
        kind = chunk.get("type") or chunk_kind(chunk)
        shapes = kinds.setdefault(kind, [])
        if shape(chunk) not in shapes:
            shapes.append(shape(chunk))
    return kinds


def chunk_kind(chunk: dict[str, Any]) -> str:
    """A chat or completion chunk by its part in the stream."""
    if chunk.get("usage") and not chunk.get("choices"):
        return "usage"
    choice = (chunk.get("choices") or [{}])[0]
    if choice.get("finish_reason"):
        return "last"
    if (choice.get("delta") or {}).get("role"):
        return "role"
    return "text"


JSON = {"Content-Type": "application/json"}
PROMPT = text_for("diff", 120)
TOO_LONG = text_for("too-long", 3000)
CHAT = [{"role": "user", "content": PROMPT}]
# A reply that must call a tool (a coding agent's turn), cut at max_tokens: streamed, the
# call's head and pieces of its arguments; whole, the raw text and no call. Seeded, so
# the real engine's random weights say the same each run, and short: given more tokens
# they may close the call early, which a trained model's calls do not.
CALL: dict[str, Any] = {
    "tools": list(AGENT_TOOLS),
    "tool_choice": "required",
    "max_tokens": 24,
    "ignore_eos": True,
    "seed": 7,
}
# (name, path, body): what both engines are asked, in order; the prefix cache is empty
# before the first and the chat prompt is asked twice, so the second reads the cache.
REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("chat whole", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8}),
    (
        "chat stream",
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    ("completion whole", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8}),
    (
        "completion stream",
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    ("messages whole", "/v1/messages", {"messages": CHAT, "max_tokens": 8}),
    ("messages stream", "/v1/messages", {"messages": CHAT, "max_tokens": 8, "stream": True}),
    ("responses whole", "/v1/responses", {"input": PROMPT, "max_output_tokens": 8}),
    (
        "responses stream",
        "/v1/responses",
        {"input": PROMPT, "max_output_tokens": 8, "stream": True},
    ),
    (
        "chat too long",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 8},
    ),
    (
        "messages too long",
        "/v1/messages",
        {"messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 8},
    ),
    ("responses too long", "/v1/responses", {"input": TOO_LONG, "max_output_tokens": 8}),
    ("chat tool call whole", "/v1/chat/completions", {"messages": CHAT, **CALL}),
    (
        "chat tool call stream",
        "/v1/chat/completions",
        {"messages": CHAT, "stream": True, "stream_options": {"include_usage": True}, **CALL},
    ),
    ("chat unknown model", "/v1/chat/completions", {"messages": CHAT, "model": "nope"}),
    ("chat no messages", "/v1/chat/completions", {"max_tokens": 8}),
]


@contextlib.asynccontextmanager
async def simulated_twin(real: VllmEngine) -> AsyncIterator[RunningEngine]:
    """The simulator serving what ``real`` serves: its model files, block size, cache
    size and context length, its tokenizer, its KV events."""
    events, replay = free_ports(2)
    kv_events = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{events}",
        replay_endpoint=f"tcp://127.0.0.1:{replay}",
    )
    config = EngineConfig(
        kv_events=kv_events,
        model=load_model(str(real.model_dir / "config.json")),
        gpu=gpu("h100"),
        served_model_name=MODEL_NAME,
        kv_tokens=NUM_BLOCKS * BLOCK_TOKENS,
        block_tokens=BLOCK_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        tokenizer=str(real.model_dir),
        responses_store=True,
        # Steps long enough to stream apart: a tiny model's decode step is microseconds,
        # and the simulator sends the tokens of steps due within its clock's resolution
        # together, so an 8-token reply could come as one chunk with its finish_reason
        # and no plain text chunk to compare.
        time_scale=1.0,
        step_overhead_s=0.01,
        stream_flush_wall_s=0.0,
    )
    async with serve_engine(config) as running:
        yield running


async def ask_all(http: aiohttp.ClientSession, url: str) -> dict[str, Observed]:
    async with http.post(url + "/reset_prefix_cache") as response:
        assert response.status == 200
    seen = {}
    for name, path, body in REQUESTS:
        seen[name] = await observe(http, url, path, {"model": MODEL_NAME, **body})
    for path in ("/v1/models", "/version"):
        async with http.get(url + path) as response:
            reply = await response.json()
            seen[path] = Observed(response.status, response.headers["Content-Type"], shape(reply))
    return seen


def compared(real: dict[str, Observed], sim: dict[str, Observed]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name in real:
        r, s = real[name], sim[name]
        diffs = []
        if r.status != s.status:
            diffs.append(f"status: {r.status} != {s.status}")
        if r.content_type != s.content_type:
            diffs.append(f"content-type: {r.content_type} != {s.content_type}")
        diffs += differences(r.body, s.body)
        if r.error != s.error:
            diffs.append(
                f"error: {orjson.dumps(r.error).decode()} != {orjson.dumps(s.error).decode()}"
            )
        if diffs:
            found[name] = sorted(diffs)
    return found


async def replayed_events(replay_endpoint: str) -> list[dict[str, Any]]:
    """The KV events an engine announced since its cache was last reset (``ask_all``
    resets it first), from its replay endpoint: what earlier tests made it announce is
    not this comparison's."""
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    events: list[dict[str, Any]] = []
    try:
        await dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        while await dealer.poll(5000):
            _, *frames = await dealer.recv_multipart()
            if frames[-1] == b"":  # the end of the replay
                cleared = [i for i, e in enumerate(events) if e["type"] == "AllBlocksCleared"]
                return events[cleared[-1] :] if cleared else events
            _, batch, *_ = msgspec.msgpack.decode(frames[-1])
            events += batch
        raise AssertionError(f"{replay_endpoint}: no end of replay")
    finally:
        dealer.close(linger=0)
        context.term()


def event_fields(events: list[dict[str, Any]]) -> dict[str, dict[str, list[str]]]:
    """Each event type's fields, with the kinds of value each took."""
    fields: dict[str, dict[str, set[str]]] = {}
    for event in events:
        kinds = fields.setdefault(event["type"], {})
        for name, value in event.items():
            kinds.setdefault(name, set()).add(str(shape(value)))
    return {kind: {k: sorted(v) for k, v in named.items()} for kind, named in fields.items()}


def metric_families(text: str) -> dict[str, set[frozenset[str]]]:
    """vLLM's series by name, each with the label names it carries."""
    families: dict[str, set[frozenset[str]]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        for sample in family.samples:
            families.setdefault(sample.name, set()).add(frozenset(sample.labels))
    return families


async def test_the_simulator_answers_as_vllm_does(vllm_fleet: list[VllmEngine]) -> None:
    real = vllm_fleet[0]
    async with simulated_twin(real) as sim, aiohttp.ClientSession() as http:
        seen_real = await ask_all(http, real.url)
        seen_sim = await ask_all(http, sim.url)
        metrics = {}
        for name, url in (("real", real.url), ("sim", sim.url)):
            async with http.get(url + "/metrics") as response:
                metrics[name] = metric_families(await response.text())
        assert sim.config.kv_events is not None and sim.config.kv_events.replay_endpoint
        events_real = await replayed_events(real.replay_endpoint)
        events_sim = await replayed_events(sim.config.kv_events.replay_endpoint)
    found = compared(seen_real, seen_sim)
    assert found == {}, orjson.dumps(found, option=orjson.OPT_INDENT_2).decode()
    assert sorted(metrics["real"]) == sorted(metrics["sim"])
    for name, label_sets in metrics["real"].items():
        assert metrics["sim"][name] == label_sets, name
    assert event_fields(events_sim) == event_fields(events_real)
    vocabulary = QWEN3_TINY["vocab_size"]
    for event in events_sim:
        assert all(0 <= t < vocabulary for t in event.get("token_ids", ())), event
