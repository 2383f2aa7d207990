"""A stand-in engine that answers at once: what a router costs when the engine costs nothing.

A raw asyncio HTTP/1.1 server (keep-alive, Content-Length or chunked request bodies)
answering a fixed OpenAI chat or text completion, whole or streamed as SSE (``"stream":
true``; a usage event when ``stream_options.include_usage`` asks for one), plus what
the routers probe before they route: ``/health``, ``/v1/models``, ``/metrics`` (vLLM's
``cache_config_info``, so kvrouter reads a KV capacity), SGLang's ``/get_server_info``
and ``/get_model_info``, and vLLM's ``/tokenize`` and render endpoints (vllm-router's
cache_aware asks for token ids: the prompt's text cut into 4-byte ids).
``GET /standin/stats`` counts the requests per method and path (``"POST /tokenize"``)
since the process started, so a benchmark can tell how many engine calls a router makes
per request it routes.

It costs 10-20 µs of CPU a request (``bench throughput`` prints it), well under what the
routers it stands behind cost, and one process can listen on several ports, each one a
worker to the router::

    python -m bench.throughput.standin --host 127.0.0.1 --ports 8100,8101,8102,8103
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import struct
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, cast

import orjson

MODEL = "m"
KV_TOKENS = 400_000
BLOCK_TOKENS = 16
MAX_MODEL_LEN = 131_072
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 8 * 1024 * 1024
REPLY_TEXT = "The quick brown fox jumps over the lazy dog again."
REPLY_TOKENS = 12
_STARTED = time.time()


def _response(status: str, content_type: str, body: bytes) -> bytes:
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


def _json(body: Any, status: str = "200 OK") -> bytes:
    return _response(status, "application/json", orjson.dumps(body))


def _usage(prompt_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": REPLY_TOKENS,
        "total_tokens": prompt_tokens + REPLY_TOKENS,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _whole(kind: str, prompt_tokens: int) -> bytes:
    created = int(_STARTED)
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": REPLY_TEXT},
            "finish_reason": "length",
        }
        head = {"id": "chatcmpl-standin", "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": REPLY_TEXT, "finish_reason": "length"}
        head = {"id": "cmpl-standin", "object": "text_completion"}
    body = {
        **head,
        "created": created,
        "model": MODEL,
        "choices": [choice],
        "usage": _usage(prompt_tokens),
    }
    return _json(body)


def _stream_events(kind: str, prompt_tokens: int, include_usage: bool) -> list[bytes]:
    """The SSE events of a streamed reply: a role chunk (chat), the text in four pieces,
    the usage event if asked for, ``[DONE]``."""
    created = int(_STARTED)
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    rid = "chatcmpl-standin" if kind == "chat" else "cmpl-standin"
    words = REPLY_TEXT.split(" ")
    pieces = [" ".join(words[i : i + 3]) + " " for i in range(0, len(words), 3)]
    chunks: list[dict[str, Any]] = []
    if kind == "chat":
        chunks.append(
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        )
    for i, piece in enumerate(pieces):
        finish = "length" if i == len(pieces) - 1 else None
        if kind == "chat":
            chunks.append({"index": 0, "delta": {"content": piece}, "finish_reason": finish})
        else:
            chunks.append({"index": 0, "text": piece, "finish_reason": finish})
    events = [
        {"id": rid, "object": obj, "created": created, "model": MODEL, "choices": [c]}
        for c in chunks
    ]
    if include_usage:
        events.append(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": MODEL,
                "choices": [],
                "usage": _usage(prompt_tokens),
            }
        )
    return [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def _streamed(kind: str, prompt_tokens: int, include_usage: bool) -> bytes:
    """The whole streamed response, each event one HTTP chunk, in one write."""
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    chunks = [
        f"{len(e):x}\r\n".encode() + e + b"\r\n"
        for e in _stream_events(kind, prompt_tokens, include_usage)
    ]
    return head + b"".join(chunks) + b"0\r\n\r\n"


def _metrics_text() -> bytes:
    return (
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{BLOCK_TOKENS}",'
        f'num_gpu_blocks="{KV_TOKENS // BLOCK_TOKENS}"}} 1.0\n'
        f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0\n'
        f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0.0\n'
        f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.0\n'
        f"process_start_time_seconds {_STARTED}\n"
    ).encode()


def prompt_text(body: dict[str, Any]) -> str:
    """A request's prompt as text: a completion's ``prompt``, or a chat's message
    contents joined (roles and template left out: no engine is matched here)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    parts: list[str] = []
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p["text"] for p in content if isinstance(p, dict) and "text" in p)
    return "\n".join(parts)


def token_ids(text: str) -> list[int]:
    """The text's UTF-8 cut into 4-byte little-endian ids (as the simulator's tokenizer)."""
    raw = text.encode()
    raw += b"\xff" * (-len(raw) % 4)
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


class Replies:
    """The fixed answers, built once; only what depends on the request is computed."""

    def __init__(self) -> None:
        self.health = _response("200 OK", "text/plain", b"")
        self.models = _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": MODEL,
                        "object": "model",
                        "created": int(_STARTED),
                        "owned_by": "vllm",
                        "root": MODEL,
                        "parent": None,
                        "max_model_len": MAX_MODEL_LEN,
                        "permission": [],
                    }
                ],
            }
        )
        self.metrics = _response("200 OK", "text/plain; version=0.0.4", _metrics_text())
        self.model_info = _json(
            {"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True}
        )
        self.server_info = _json(
            {
                "model_path": MODEL,
                "served_model_name": MODEL,
                "max_total_num_tokens": KV_TOKENS,
                "context_length": MAX_MODEL_LEN,
            }
        )
        self.not_found = _json({"error": {"message": "not found", "code": 404}}, "404 Not Found")
        self.bad_request = _json(
            {"error": {"message": "bad request", "code": 400}}, "400 Bad Request"
        )
        self._cache: dict[tuple[str, int, bool, bool], bytes] = {}

    def completion(self, kind: str, body: dict[str, Any]) -> bytes:
        prompt_tokens = max(1, len(prompt_text(body)) // 4)
        stream = body.get("stream") is True
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        key = (kind, prompt_tokens, stream, include_usage)
        reply = self._cache.get(key)
        if reply is None:
            reply = (
                _streamed(kind, prompt_tokens, include_usage)
                if stream
                else _whole(kind, prompt_tokens)
            )
            if len(self._cache) < 4096:
                self._cache[key] = reply
        return reply


class StandinProtocol(asyncio.Protocol):
    """One client connection: requests parsed from the buffer as they complete."""

    def __init__(self, replies: Replies, counts: Counter[str]) -> None:
        self._replies = replies
        self._counts = counts
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while self._transport is not None and self._one_request():
            pass

    def _one_request(self) -> bool:
        """Answer the first complete request in the buffer; False: none is complete."""
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > MAX_HEADER_BYTES:
                self._close()
            return False
        head = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
        method, _, rest = head[0].partition(" ")
        path = rest.partition(" ")[0].partition("?")[0]
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        start = end + 4
        if headers.get("transfer-encoding", "").lower() == "chunked":
            found = _chunked_body(self._buffer, start)
            if found is None:
                return False
            body, stop = found
        else:
            length = int(headers.get("content-length") or 0)
            if length > MAX_BODY_BYTES:
                self._close()
                return False
            if len(self._buffer) < start + length:
                return False
            body, stop = bytes(self._buffer[start : start + length]), start + length
        del self._buffer[:stop]
        assert self._transport is not None
        self._transport.write(self._answer(method, path, body))
        if headers.get("connection", "").lower() == "close":
            self._close()
        return True

    def _answer(self, method: str, path: str, body: bytes) -> bytes:
        self._counts[f"{method} {path}"] += 1
        r = self._replies
        if method == "GET":
            fixed = {
                "/health": r.health,
                "/health_generate": r.health,
                "/v1/models": r.models,
                "/metrics": r.metrics,
                "/get_model_info": r.model_info,
                "/model_info": r.model_info,
                "/get_server_info": r.server_info,
                "/server_info": r.server_info,
            }
            if path == "/standin/stats":
                return _json(dict(self._counts))
            return fixed.get(path, r.not_found)
        try:
            parsed = orjson.loads(body) if body else {}
        except orjson.JSONDecodeError:
            return r.bad_request
        if not isinstance(parsed, dict):
            return r.bad_request
        if path == "/v1/chat/completions":
            return r.completion("chat", parsed)
        if path == "/v1/completions":
            return r.completion("completion", parsed)
        if path == "/tokenize":
            ids = token_ids(prompt_text(parsed))
            return _json(
                {
                    "count": len(ids),
                    "max_model_len": MAX_MODEL_LEN,
                    "tokens": ids,
                    "token_strs": None,
                }
            )
        if path in ("/v1/chat/completions/render", "/v1/completions/render"):
            rendered = {
                "request_id": "standin",
                "token_ids": token_ids(prompt_text(parsed)),
                "model": parsed.get("model"),
                "stream": parsed.get("stream", False),
            }
            return _json(rendered if path.startswith("/v1/chat") else [rendered])
        return r.not_found

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None


def _chunked_body(buffer: bytearray, start: int) -> tuple[bytes, int] | None:
    """A chunked body starting at ``start``, and where it ends; None: not all here yet."""
    body = bytearray()
    at = start
    while True:
        line_end = buffer.find(b"\r\n", at)
        if line_end < 0:
            return None
        size = int(bytes(buffer[at:line_end]).split(b";")[0], 16)
        at = line_end + 2
        if size == 0:
            trailer_end = buffer.find(b"\r\n", at)  # no trailers are sent to an engine
            return (bytes(body), trailer_end + 2) if trailer_end >= 0 else None
        if len(buffer) < at + size + 2:
            return None
        body += buffer[at : at + size]
        at += size + 2


async def start_standin(host: str, ports: Sequence[int]) -> list[asyncio.Server]:
    """Listen on every port (0: a free one) with one shared set of replies and counts."""
    replies, counts = Replies(), Counter[str]()
    loop = asyncio.get_running_loop()
    return [
        await loop.create_server(lambda: StandinProtocol(replies, counts), host, port, backlog=1024)
        for port in ports
    ]


async def _serve(host: str, ports: Sequence[int]) -> None:
    servers = await start_standin(host, ports)
    try:
        await asyncio.Event().wait()
    finally:
        for server in servers:
            server.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.throughput.standin",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--ports", required=True, help="comma-separated ports")
    args = parser.parse_args(argv)
    ports = [int(p) for p in args.ports.split(",") if p]
    try:
        import uvloop
    except ImportError:
        run = asyncio.run
    else:
        run = uvloop.run
    with contextlib.suppress(KeyboardInterrupt):
        run(_serve(args.host, ports))


if __name__ == "__main__":
    main()
