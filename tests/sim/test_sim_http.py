"""The simulated engine's two HTTP front-ends send the same bytes.

``bench/sim/server.py`` (aiohttp, in-process engines) and ``bench/sim/http1.py``
(httptools, the engine's own process) carry the same endpoints (``bench/sim/api.py``).
Each case below is sent as raw bytes to a fresh engine behind each front-end, in the
same order, and the answers are compared byte for byte once the date, the response ids
and the creation times are blanked. Streams are compared as the events they carry: how
the events group into chunks depends on when the handler wakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import socket
from collections.abc import AsyncIterator, Sequence

import httptools
import orjson
import pytest

from bench.sim.config import EngineConfig
from bench.sim.engine import running_engine
from bench.sim.http1 import serving
from tests.conftest import engine_config
from tests.sim_servers import FRONTS, serve_engine_on

Front = str  # "aiohttp" or "httptools"


@contextlib.asynccontextmanager
async def front_port(front: Front, config: EngineConfig) -> AsyncIterator[int]:
    """A fresh engine of ``config`` behind ``front`` on a loopback port."""
    async with serve_engine_on(front, config) as running:
        yield int(running.url.rsplit(":", 1)[1])


class _Count:
    def __init__(self) -> None:
        self.done = 0

    def on_message_complete(self) -> None:
        self.done += 1


async def send(port: int, data: bytes, responses: int = 1) -> bytes:
    """Send ``data`` on a new connection; read until ``responses`` responses are complete
    or the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    count = _Count()
    parser = httptools.HttpResponseParser(count)
    received = bytearray()
    try:
        while count.done < responses:
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            if not chunk:
                break
            received += chunk
            with contextlib.suppress(httptools.HttpParserError):
                parser.feed_data(chunk)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return bytes(received)


def request(
    method: str, path: str, body: object = None, headers: Sequence[str] = (), version: str = "1.1"
) -> bytes:
    raw = b"" if body is None else body if isinstance(body, bytes) else orjson.dumps(body)
    lines = [f"{method} {path} HTTP/{version}", "Host: engine", *headers]
    if body is not None:
        lines.append(f"Content-Length: {len(raw)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + raw


def normalized(raw: bytes) -> bytes:
    raw = re.sub(rb"Date: [^\r]*\r\n", b"Date: -\r\n", raw)
    raw = re.sub(rb"(chatcmpl|cmpl)-[0-9a-f]{32}", rb"\1-id", raw)
    raw = re.sub(rb'"created":\d+', b'"created":0', raw)
    # Floats of varying length (so the length varies too): a start time, simulated times.
    times = rb'"(process_start_time_seconds|arrived|scheduled|first_token)":[0-9.e+-]+'
    if re.search(times, raw):
        raw = re.sub(rb"Content-Length: \d+", b"Content-Length: -", re.sub(times, rb'"\1":0', raw))
    return raw


def events(raw: bytes) -> tuple[bytes, list[bytes]]:
    """A chunked SSE response as its head and its events, the chunks' framing checked."""
    head, _, body = raw.partition(b"\r\n\r\n")
    data = bytearray()
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert body == b"\r\n", "the last chunk ends the body"
            break
        data += body[:size]
        assert body[size : size + 2] == b"\r\n"
        body = body[size + 2 :]
    return normalized(head), [normalized(e) for e in bytes(data).split(b"\n\n") if e]


def metric_lines(raw: bytes) -> tuple[bytes, list[bytes]]:
    """A /metrics answer as its head (length left out) and its series without values."""
    head, _, body = normalized(raw).partition(b"\r\n\r\n")
    head = re.sub(rb"Content-Length: \d+", b"Content-Length: -", head)
    return head, [line.rpartition(b" ")[0] for line in body.splitlines()]


def collapsed(shapes: list[bytes]) -> list[bytes]:
    """``shapes`` with runs of the same shape kept once."""
    return [shape for i, shape in enumerate(shapes) if i == 0 or shapes[i - 1] != shape]


def merged_text(sse: list[bytes]) -> tuple[str, list[bytes]]:
    """The text the events carry, and the events with their text blanked (a run of
    Anthropic text deltas as one)."""
    text: list[str] = []
    shapes: list[bytes] = []
    for event in sse:
        if event == b"data: [DONE]":
            shapes.append(event)
            continue
        if event.startswith(b"event: "):  # Anthropic's: the name, then the data
            name, _, data = event.partition(b"\ndata: ")
            frame = orjson.loads(data)
            if frame["type"] == "content_block_delta":
                text.append(frame["delta"]["text"])
                frame["delta"]["text"] = "-"
            shape = name + b"\n" + orjson.dumps(frame)
            # How many deltas carry the text is the flush timing's: one shape for a run.
            if frame["type"] != "content_block_delta" or not shapes or shapes[-1] != shape:
                shapes.append(shape)
            continue
        chunk = orjson.loads(event.removeprefix(b"data: "))
        for choice in chunk["choices"]:
            piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
            text.append(piece or "")
            if "delta" in choice and "content" in choice["delta"]:
                choice["delta"]["content"] = "-"
            if "text" in choice:
                choice["text"] = "-"
        shapes.append(orjson.dumps(chunk))
    return "".join(text), shapes


CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
EXACT = {**CHAT, "ignore_eos": True}
STREAM = {**EXACT, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}}
COMPLETION = {"model": "sim-model", "prompt": "hello there", "max_tokens": 2, "ignore_eos": True}
MESSAGES = {
    "model": "sim-model",
    "system": "Be brief.",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
    "min_tokens": 3,
}
NO_MAX_TOKENS = {k: v for k, v in MESSAGES.items() if k != "max_tokens"}
# Anthropic messages carry chat's id, from X-Request-Id when sent.
MESSAGE_ID = ["X-Request-Id: m-1"]

# (name, request bytes, responses to wait for); sent in this order to each front-end.
CASES: list[tuple[str, bytes, int]] = [
    ("health", request("GET", "/health"), 1),
    ("health, query string", request("GET", "/health?probe=1"), 1),
    ("health, HEAD", request("HEAD", "/health", headers=["Connection: close"]), 1),
    ("models", request("GET", "/v1/models"), 1),
    ("models, HEAD", request("HEAD", "/v1/models", headers=["Connection: close"]), 1),
    ("version", request("GET", "/version"), 1),
    ("metrics", request("GET", "/metrics"), 1),
    ("unknown path", request("GET", "/nope"), 1),
    ("trailing slash", request("GET", "/health/"), 1),
    ("wrong method", request("GET", "/v1/chat/completions"), 1),
    ("POST a GET route", request("POST", "/health", b""), 1),
    ("OPTIONS", request("OPTIONS", "/v1/models"), 1),
    ("HEAD a POST route", request("HEAD", "/v1/completions", headers=["Connection: close"]), 1),
    ("chat", request("POST", "/v1/chat/completions", EXACT), 1),
    ("chat, natural length", request("POST", "/v1/chat/completions", CHAT), 1),
    ("chat, stream of one token", request("POST", "/v1/chat/completions", STREAM), 1),
    ("completion", request("POST", "/v1/completions", COMPLETION), 1),
    ("messages", request("POST", "/v1/messages", MESSAGES, MESSAGE_ID), 1),
    (
        "messages, stream",
        request("POST", "/v1/messages", {**MESSAGES, "stream": True}, MESSAGE_ID),
        1,
    ),
    ("messages, no max_tokens", request("POST", "/v1/messages", NO_MAX_TOKENS), 1),
    ("messages, unknown model", request("POST", "/v1/messages", {**MESSAGES, "model": "x"}), 1),
    ("count tokens", request("POST", "/v1/messages/count_tokens", MESSAGES), 1),
    ("not JSON", request("POST", "/v1/chat/completions", b"{nope"), 1),
    ("unknown model", request("POST", "/v1/completions", {**COMPLETION, "model": "x"}), 1),
    ("too long", request("POST", "/v1/completions", {**COMPLETION, "max_tokens": 10**7}), 1),
    ("tokenize", request("POST", "/tokenize", {"prompt": "hello"}), 1),
    ("detokenize", request("POST", "/detokenize", {"tokens": [1819043176]}), 1),
    ("render", request("POST", "/v1/chat/completions/render", CHAT), 1),
    ("render completion", request("POST", "/v1/completions/render", COMPLETION), 1),
    ("faults", request("GET", "/sim/faults"), 1),
    ("bad fault", request("POST", "/sim/faults", {"explode": True}), 1),
    ("faults not an object", request("POST", "/sim/faults", [1]), 1),
    ("fail requests", request("POST", "/sim/faults", {"fail_requests": True}), 1),
    ("failing chat", request("POST", "/v1/chat/completions", EXACT), 1),
    ("failing messages", request("POST", "/v1/messages", MESSAGES), 1),
    ("unusual fail status", request("POST", "/sim/faults", {"fail_status": 599}), 1),
    ("failing with 599", request("POST", "/v1/completions", COMPLETION), 1),
    ("heal", request("POST", "/sim/faults", {"fail_requests": False, "fail_status": 500}), 1),
    ("failing health", request("POST", "/sim/faults", {"fail_health": True}), 1),
    ("unhealthy", request("GET", "/health"), 1),
    (
        "failing metrics",
        request("POST", "/sim/faults", {"fail_health": False, "fail_metrics": True}),
        1,
    ),
    ("no metrics", request("GET", "/metrics"), 1),
    ("metrics back", request("POST", "/sim/faults", {"fail_metrics": False}), 1),
    ("Connection: close", request("GET", "/health", headers=["Connection: close"]), 1),
    ("HTTP/1.0", request("GET", "/version", version="1.0"), 1),
    (
        "HTTP/1.0 keep-alive",
        request("GET", "/version", headers=["Connection: keep-alive"], version="1.0"),
        1,
    ),
    (
        "HTTP/1.0 stream",
        request(
            "POST",
            "/v1/completions",
            {**COMPLETION, "max_tokens": 1, "stream": True},
            version="1.0",
        ),
        1,
    ),
    ("pipelined", request("GET", "/health") + request("GET", "/version"), 2),
    ("absolute URL", request("GET", "http://engine/version"), 1),
    ("percent-encoded path", request("GET", "/v%31/models"), 1),
    (
        "Expect: 100-continue",
        request("POST", "/v1/completions", COMPLETION, ["Expect: 100-continue"]),
        2,
    ),
    ("unknown Expect", request("POST", "/v1/completions", COMPLETION, ["Expect: later"]), 1),
    (
        "chunked request body",
        b"POST /tokenize HTTP/1.1\r\nHost: e\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'6\r\n{"prom\r\nf\r\npt": "chunked"}\r\n0\r\n\r\n',
        1,
    ),
    (
        "completion, X-Request-Id twice",
        request("POST", "/v1/completions", COMPLETION, ["X-Request-Id: r-7", "X-Request-Id: r-8"]),
        1,
    ),
    ("requests", request("GET", "/sim/requests"), 1),
    ("restart", request("POST", "/sim/restart"), 1),
    ("requests after restart", request("GET", "/sim/requests"), 1),
]


async def answers(
    front: Front, config: EngineConfig, cases: list[tuple[str, bytes, int]]
) -> dict[str, bytes]:
    async with front_port(front, config) as port:
        return {name: await send(port, data, n) for name, data, n in cases}


async def test_the_front_ends_answer_alike() -> None:
    config = engine_config()
    got = {front: await answers(front, config, CASES) for front in FRONTS}
    for name, _, _ in CASES:
        aiohttp_answer, httptools_answer = got["aiohttp"][name], got["httptools"][name]
        if name == "metrics":
            # The values are timings; the head and the series are the same.
            assert metric_lines(aiohttp_answer) == metric_lines(httptools_answer)
        elif b"text/event-stream" in aiohttp_answer and b"chunked" in aiohttp_answer:
            head_a, events_a = events(aiohttp_answer)
            head_h, events_h = events(httptools_answer)
            assert head_a == head_h, name
            assert merged_text(events_a) == merged_text(events_h), name
        else:
            assert normalized(aiohttp_answer) == normalized(httptools_answer), name
    assert got["aiohttp"]["metrics"].startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"text/event-stream" in got["httptools"]["chat, stream of one token"]
    assert b"event: message_stop" in got["httptools"]["messages, stream"]
    assert b'"type":"InternalServerError"' in got["aiohttp"]["failing messages"]
    listed = orjson.loads(got["httptools"]["requests"].partition(b"\r\n\r\n")[2])["requests"]
    assert [r["request_id"] for r in listed].count("r-7") == 1  # the first header of two
    assert got["aiohttp"]["requests after restart"].endswith(b'\r\n\r\n{"requests":[]}')


async def test_an_api_key_guards_v1_alike() -> None:
    config = dataclasses.replace(engine_config(), api_key="k")
    cases = [
        ("no key", request("GET", "/v1/models"), 1),
        ("wrong key", request("GET", "/v1/models", headers=["Authorization: Bearer no"]), 1),
        ("key", request("GET", "/v1/models", headers=["Authorization: bearer k"]), 1),
        ("unknown /v1 path", request("GET", "/v1/nope"), 1),
        (
            "unknown /v1 path, key",
            request("GET", "/v1/nope", headers=["Authorization: Bearer k"]),
            1,
        ),
        ("OPTIONS", request("OPTIONS", "/v1/models"), 1),
        ("health is open", request("GET", "/health"), 1),
    ]
    got = {front: await answers(front, config, cases) for front in FRONTS}
    for name, _, _ in cases:
        assert normalized(got["aiohttp"][name]) == normalized(got["httptools"][name]), name
    assert got["httptools"]["no key"].startswith(b"HTTP/1.1 401 Unauthorized\r\n")


async def test_sglang_routes_alike() -> None:
    config = dataclasses.replace(engine_config(), flavor="sglang")
    cases = [
        (path, request("GET", path), 1)
        for path in ("/model_info", "/get_server_info", "/health_generate", "/tokenize")
    ]
    got = {front: await answers(front, config, cases) for front in FRONTS}
    for name, _, _ in cases:
        assert normalized(got["aiohttp"][name]) == normalized(got["httptools"][name]), name


@pytest.mark.parametrize("front", FRONTS)
async def test_a_restart_fails_whole_requests_and_cuts_streams(front: Front) -> None:
    """Dropped by a restart: a whole reply becomes aiohttp's 500 and the connection
    closes; a stream stops without its last chunk."""
    long = {**EXACT, "max_tokens": 20_000}
    async with front_port(front, engine_config()) as port:
        whole = asyncio.create_task(send(port, request("POST", "/v1/chat/completions", long)))
        stream = asyncio.create_task(
            send(port, request("POST", "/v1/chat/completions", {**long, "stream": True}))
        )
        await asyncio.sleep(0.5)
        await send(port, request("POST", "/sim/restart"))
        dropped, cut = await asyncio.wait_for(asyncio.gather(whole, stream), 10)
    assert dropped.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
    assert b"Connection: close\r\n" in dropped
    assert dropped.endswith(b"\r\n\r\n500 Internal Server Error\n\nServer got itself in trouble")
    assert cut.startswith(b"HTTP/1.1 200 OK\r\n")
    assert not cut.endswith(b"0\r\n\r\n")


async def test_a_client_that_leaves_mid_stream_frees_its_request() -> None:
    """The connection's end cancels the request it was answering, whose blocks go back."""
    config = engine_config()
    async with running_engine(config) as engine, serving(engine, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        body = {**EXACT, "max_tokens": 20_000, "stream": True}
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request("POST", "/v1/chat/completions", body))
        await reader.readuntil(b"\r\n\r\n")
        assert engine.scheduler.has_work
        writer.close()
        for _ in range(100):
            if not engine.scheduler.has_work:
                break
            await asyncio.sleep(0.02)
        assert not engine.scheduler.has_work


async def test_long_streams_carry_the_same_events() -> None:
    """Tokens sent as they come (no flush interval): on the httptools front-end the
    engine writes them itself as it publishes them (``sse.stream_completion``'s write-through);
    the events, their text and their order are those of the aiohttp front-end."""
    config = dataclasses.replace(engine_config(), stream_flush_wall_s=0.0, time_scale=5.0)
    body = {**EXACT, "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}}
    cases = [
        ("chat", request("POST", "/v1/chat/completions", body), 1),
        (
            "completion",
            request("POST", "/v1/completions", {**body, **COMPLETION, "max_tokens": 40}),
            1,
        ),
    ]
    got = {front: await answers(front, config, cases) for front in FRONTS}
    for name, _, _ in cases:
        head_a, events_a = events(got["aiohttp"][name])
        head_h, events_h = events(got["httptools"][name])
        assert head_a == head_h, name
        (text_a, shapes_a), (text_h, shapes_h) = merged_text(events_a), merged_text(events_h)
        assert text_a == text_h, name
        # How many text events there are depends on when tokens were handed out.
        assert collapsed(shapes_a) == collapsed(shapes_h), name
        chunks = got["httptools"][name].partition(b"\r\n\r\n")[2].count(b"\r\ndata: ")
        assert chunks >= 3, f"{name}: {chunks} chunks, the tokens were not streamed"


async def test_a_slow_reader_gets_the_whole_stream() -> None:
    """A client that stops reading fills its socket buffer: the httptools front-end then
    waits (the chunks go through the handler, not the engine's write-through) and the
    stream arrives whole once the client reads again."""
    config = dataclasses.replace(engine_config(), stream_flush_wall_s=0.0, time_scale=50.0)
    tokens = 6000
    body = {**EXACT, "max_tokens": tokens, "stream": True}
    async with running_engine(config) as engine, serving(engine, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        # Small kernel buffers on both ends (an accepted socket inherits the listener's).
        server.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(request("POST", "/v1/chat/completions", body, ["Connection: close"]))
        await asyncio.sleep(1.0)  # the engine keeps generating; nobody reads
        raw = await asyncio.wait_for(reader.read(), 30)  # read(): until the server closes
        writer.close()
    head, sse = events(raw)
    text, _ = merged_text(sse)
    assert head.startswith(b"HTTP/1.1 200 OK") and len(text) == tokens * 4
    assert sse[-1] == b"data: [DONE]"


async def test_malformed_requests_get_a_400_and_the_end_of_the_connection() -> None:
    """Not HTTP, a header past 8190 bytes, more than 128 headers: both front-ends answer
    aiohttp's ``HTTP/1.0 400`` in plain text and close; only the text differs (each
    says what its parser saw)."""
    many = "".join(f"X-{i}: v\r\n" for i in range(130))
    cases = [
        ("not HTTP", b"BLAH\r\n\r\n", 1),
        ("long header", b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 1),
        ("many headers", f"GET /health HTTP/1.1\r\n{many}\r\n".encode(), 1),
    ]
    got = {front: await answers(front, engine_config(), cases) for front in FRONTS}
    for name, _, _ in cases:
        heads = [got[front][name].partition(b"\r\n\r\n")[0] for front in FRONTS]
        without_length = [re.sub(rb"Content-Length: \d+", b"", normalized(h)) for h in heads]
        assert without_length[0] == without_length[1], name
        assert heads[1].startswith(b"HTTP/1.0 400 Bad Request\r\n"), name
