"""Hypothesis strategies for a hostile engine: what it answers a forwarded request, its
``/metrics`` pages and its KV-event messages.

An answer starts from what vLLM sends (a chat completion, whole or streamed as SSE) and is
then bent: a status line or header that is not HTTP, headers past the router's limits, a
length that lies, chunk framing that breaks, usage numbers that are negative, huge or not
numbers, SSE events that are cut, never end or are huge, JSON that is not, a connection
that closes, resets or goes silent, bytes that trickle in. "Endless" input is finite here
(a few MiB, a few seconds) but past every limit the router keeps.

Metrics pages carry the samples the router reads (load, ``cache_config_info``, the
process start) with values that are not counts, and lines that are not Prometheus. KV
events are vLLM's frames (``topic, seq, msgpack batch``) with events of the wrong shape,
claims of millions of blocks, sequence numbers that jump or go back, and bytes that are
not msgpack.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

import msgspec
from hypothesis import strategies as st

from bench.fuzz.inputs import ints, json_values, pick, serialize

Strategy = st.SearchStrategy


End = Literal["close", "reset", "silent", "keep"]

ENDLESS_BYTES = 4 * 1024 * 1024  # past the router's 64 KiB head and 1 MiB SSE event
MAX_PAUSE_S = 0.2
SILENT_S = 1.5  # past the fuzz router's read timeout


@dataclass(frozen=True, slots=True)
class Reply:
    """What the engine writes on the connection a request came in on."""

    pieces: tuple[bytes, ...]  # each written on its own
    pause_s: float = 0.0  # between pieces
    end: End = "keep"  # keep: the connection stays open for the next request
    status: int = 200  # the status the head names (0: not an HTTP status line)

    @property
    def size(self) -> int:
        return sum(map(len, self.pieces))


@dataclass(frozen=True, slots=True)
class EngineCase:
    """One generated case: the answer to the next forwarded request, the page the next
    scrapes get, and the KV-event messages published with it."""

    reply: Reply
    metrics: Reply | None = None
    kv_messages: tuple[tuple[bytes, ...], ...] = ()
    stream: bool = False
    api: str = "chat"
    labels: frozenset[str] = field(default_factory=frozenset)  # what was hostile in it


# -- numbers ---------------------------------------------------------------------------------


@cache
def odd_numbers() -> Strategy[Any]:
    """What an engine may put where a count belongs."""
    return st.one_of(
        ints(0, 5000),
        ints(-(2**63), -1),
        ints(2**31, 2**64 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        # Serialized as numbers no serializer writes (bench.fuzz.inputs' markers).
        pick(["\x00huge-int\x00", "\x00big-float\x00", "\x00nan\x00"]),
        pick(["\x00past-u64\x00", "\x00minus-inf\x00", "12", ""]),
        st.none(),
        json_values(),
    )


@cache
def _usage() -> Strategy[Any]:
    honest = st.fixed_dictionaries(
        {"prompt_tokens": ints(1, 5000), "completion_tokens": ints(1, 50)},
        optional={
            "prompt_tokens_details": st.fixed_dictionaries({"cached_tokens": ints(0, 5000)}),
            "total_tokens": ints(1, 6000),
        },
    )
    hostile = st.fixed_dictionaries(
        {},
        optional={
            "prompt_tokens": odd_numbers(),
            "completion_tokens": odd_numbers(),
            "total_tokens": odd_numbers(),
            "prompt_tokens_details": st.one_of(
                st.fixed_dictionaries({"cached_tokens": odd_numbers()}), json_values()
            ),
        },
    )
    return st.one_of(honest, honest, hostile, json_values())


# -- bodies ----------------------------------------------------------------------------------


def _completion(usage: Any, text: str, finish: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fuzz",
        "object": "chat.completion",
        "created": 1,
        "model": "hostile",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
            }
        ],
        "usage": usage,
    }


def _chunk(delta: Any, finish: Any = None, usage: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": "chatcmpl-fuzz",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "hostile",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage is not None:
        body["choices"] = []
        body["usage"] = usage
    return body


@cache
def _texts() -> Strategy[str]:
    return st.one_of(st.text(max_size=20), st.just("x" * 5000))


@st.composite
def json_bodies(draw: st.DrawFn) -> tuple[bytes, frozenset[str]]:
    """A non-streamed answer's body, and what is hostile in it."""
    usage = draw(_usage())
    body = _completion(usage, draw(_texts()), draw(pick(["stop", "length", None, 7])))
    labels = {"usage"}
    choice = draw(pick(["valid"] * 4 + ["junk", "cut", "huge", "array"]))
    raw = serialize(body)
    if choice == "junk":
        raw, labels = serialize(draw(json_values())), {"body"}
    elif choice == "cut":
        raw, labels = raw[: draw(ints(0, max(0, len(raw) - 1)))], {"body"}
    elif choice == "huge":
        body["choices"][0]["message"]["content"] = "y" * ENDLESS_BYTES
        raw, labels = serialize(body), {"body", "huge"}
    elif choice == "array":
        raw, labels = b"[" * 10_000 + b"]" * 10_000, {"body"}
    return raw, frozenset(labels)


def _event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


@st.composite
def sse_bodies(draw: st.DrawFn) -> tuple[bytes, frozenset[str]]:
    """A streamed answer's body (SSE), and what is hostile in it."""
    events = [_event(serialize(_chunk({"role": "assistant", "content": ""})))]
    for text in draw(st.lists(_texts(), max_size=4)):
        events.append(_event(serialize(_chunk({"content": text}))))
    events.append(_event(serialize(_chunk({}, finish="stop"))))
    events.append(_event(serialize(_chunk({}, usage=draw(_usage())))))
    labels = {"usage"}
    odd = draw(st.lists(pick(_SSE_ODDITIES), max_size=3))
    for oddity in odd:
        at = draw(ints(0, len(events)))
        events.insert(at, _sse_oddity(oddity, draw))
        labels.add("sse")
    if draw(ints(0, 9)):
        events.append(b"data: [DONE]\n\n")
    if draw(ints(0, 19)) == 0:  # one event that never ends
        events.append(b"data: {" + b"z" * ENDLESS_BYTES)
        labels |= {"sse", "huge"}
    return b"".join(events), frozenset(labels)


_SSE_ODDITIES = (
    "junk_json",
    "not_json",
    "comment",
    "bare_lf",
    "crlf",
    "no_data",
    "huge_event",
    "many_tiny",
    "binary",
)


def _sse_oddity(kind: str, draw: st.DrawFn) -> bytes:
    if kind == "junk_json":
        return _event(serialize(draw(json_values())))
    if kind == "not_json":
        return _event(b"{not json")
    if kind == "comment":
        return b": keep-alive\n\n"
    if kind == "bare_lf":
        return b"data: {}\n"
    if kind == "crlf":
        return b"data: " + serialize(_chunk({"content": "r"})) + b"\r\n\r\n"
    if kind == "no_data":
        return b"event: x\nid: 1\nretry: 5\n\n"
    if kind == "huge_event":
        return _event(b'"' + b"h" * (2 * 1024 * 1024) + b'"')
    if kind == "many_tiny":
        return b"data: 1\n\n" * 20_000
    return _event(draw(st.binary(max_size=64)))


# -- heads and framing -------------------------------------------------------------------

_STATUSES = (200,) * 12 + (100, 101, 204, 304, 400, 404, 429, 500, 503, 999)


@st.composite
def _header_lines(draw: st.DrawFn) -> tuple[list[bytes], frozenset[str]]:
    """Extra header lines, and what is hostile in them."""
    choice = draw(pick(["none"] * 6 + ["odd", "many", "long", "endless"]))
    if choice == "none":
        return [], frozenset()
    if choice == "odd":
        lines = draw(
            st.lists(
                pick(
                    [
                        b"X-Odd: \xff\xfe",
                        b"Server: evil",
                        b"Set-Cookie: a=b",
                        b"Connection: keep-alive, Upgrade",
                        b"Trailer: X-After",
                        b"NoColon",
                        b": empty-name",
                        b"X-Folded: a\r\n b",
                        b"Content-Encoding: gzip",
                        b"X-Kvrouter-Worker: spoofed",
                    ]
                ),
                min_size=1,
                max_size=4,
            )
        )
        return lines, frozenset({"head"})
    if choice == "many":
        count = draw(pick([99, 101, 5000]))
        return [b"X-H%d: v" % i for i in range(count)], frozenset({"head"})
    if choice == "long":
        size = draw(pick([8 * 1024, 9 * 1024, 70 * 1024]))
        return [b"X-Long: " + b"v" * size], frozenset({"head"})
    return [b"X-Endless: " + b"e" * ENDLESS_BYTES], frozenset({"head", "huge"})


def _chunked(body: bytes, draw: st.DrawFn) -> tuple[bytes, frozenset[str]]:
    pieces = [body[i : i + 4096] for i in range(0, len(body), 4096)] or [b""]
    framing = draw(pick(["good"] * 6 + ["bad_size", "no_end", "huge_size", "trailer"]))
    out = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p)
    if framing == "bad_size":
        return b"zz\r\n" + out, frozenset({"framing"})
    if framing == "huge_size":
        return b"ffffffffffffffffff\r\n" + out, frozenset({"framing"})
    if framing == "no_end":
        return out, frozenset({"framing"})
    if framing == "trailer":
        return out + b"0\r\nX-Trailer: t\r\n\r\n", frozenset()
    return out + b"0\r\n\r\n", frozenset()


@st.composite
def labelled_replies(draw: st.DrawFn, stream: bool) -> tuple[Reply, frozenset[str]]:
    body, labels = draw(sse_bodies() if stream else json_bodies())
    status = draw(pick(_STATUSES))
    content_type = b"text/event-stream" if stream else b"application/json"
    odd_type = draw(pick([None] * 8 + [b"text/html", b"\xff/\xfe"]))
    if odd_type is not None:
        content_type, labels = odd_type, labels | {"head"}
    line = b"HTTP/1.1 %d OK" % status
    oddity = draw(pick(["none"] * 12 + ["version", "junk", "lf", "empty", "http09"]))
    if oddity == "version":
        line = draw(pick([b"HTTP/1.0 200 OK", b"HTTP/2 200", b"HTTP/1.1 200"]))
        status = 200
    elif oddity == "junk":
        line, status = draw(st.binary(min_size=1, max_size=40)).replace(b"\n", b""), 0
    elif oddity == "http09":
        return Reply((body,), end="close", status=0), labels | {"head"}
    if oddity != "none":
        labels |= {"head"}
    headers = [line, b"Content-Type: " + content_type]
    extra, extra_labels = draw(_header_lines())
    headers += extra
    labels |= extra_labels
    framing = draw(pick(["length"] * 5 + ["chunked"] * 3 + ["close", "lie", "both"]))
    if framing == "length":
        headers.append(b"Content-Length: %d" % len(body))
    elif framing == "chunked":
        headers.append(b"Transfer-Encoding: chunked")
        body, framing_labels = _chunked(body, draw)
        labels |= framing_labels
    elif framing == "lie":
        headers.append(b"Content-Length: %d" % draw(pick([0, len(body) + 100, -1])))
        labels |= {"framing"}
    elif framing == "both":
        headers += [b"Content-Length: 3", b"Transfer-Encoding: chunked"]
        labels |= {"framing"}
    separator = b"\n" if oddity == "lf" else b"\r\n"
    head = separator.join(headers) + separator * 2
    if oddity == "empty":
        head = b""
    wire = head + body
    end: End = "close" if framing == "close" else "keep"
    end = draw(pick([end] * 30 + ["close"] * 4 + ["reset"] * 4 + ["silent"]))
    if end != "keep":
        labels |= {"connection"}
        if end != "close" or framing != "close":
            wire = wire[: draw(ints(0, len(wire)))]
    pieces = _split(wire, draw(st.lists(ints(0, len(wire)), max_size=4)))
    pause = draw(pick([0.0] * 9 + [0.01, MAX_PAUSE_S]))
    if pause:
        labels |= {"slow"}
    return Reply(pieces, pause, end, status), frozenset(labels)


def _split(wire: bytes, cuts: list[int]) -> tuple[bytes, ...]:
    points = sorted(set(cuts) | {0, len(wire)})
    return tuple(wire[a:b] for a, b in itertools.pairwise(points)) or (b"",)


# -- /metrics --------------------------------------------------------------------------------


def _sample_value(draw: st.DrawFn) -> bytes:
    value = draw(
        st.one_of(
            ints(0, 100),
            ints(-(2**63), 2**80),
            st.floats(),
            pick(["NaN", "+Inf", "-Inf", "1e400", "x", ""]),
        )
    )
    return str(value).encode()


@st.composite
def metrics_lines(draw: st.DrawFn) -> bytes:
    kind = draw(
        pick(
            [
                "running",
                "waiting",
                "usage",
                "config",
                "start",
                "sglang",
                "junk",
                "labels",
            ]
        )
    )
    value = _sample_value(draw)
    if kind == "running":
        return b'vllm:num_requests_running{model_name="hostile"} ' + value
    if kind == "waiting":
        return b"vllm:num_requests_waiting " + value
    if kind == "usage":
        return b"vllm:kv_cache_usage_perc " + value
    if kind == "config":
        blocks, size = _sample_value(draw), _sample_value(draw)
        return b'vllm:cache_config_info{block_size="%s",num_gpu_blocks="%s"} 1.0' % (size, blocks)
    if kind == "start":
        return b"process_start_time_seconds " + value
    if kind == "sglang":
        return b"sglang:max_total_num_tokens " + value
    if kind == "labels":
        return b'vllm:num_requests_running{a="' + b"\\" * 1000 + b'"} 1'
    return draw(st.binary(max_size=80)).replace(b"\n", b" ")


@st.composite
def metrics_pages(draw: st.DrawFn) -> Reply:
    """A /metrics answer: mostly a 200 with a page of samples, now and then a huge page,
    a body that is not text, or a bent head."""
    lines = draw(st.lists(metrics_lines(), max_size=8))
    page = b"\n".join(lines) + b"\n"
    size = draw(pick(["small"] * 30 + ["big", "over"]))
    if size == "big":
        page = page * max(1, (1024 * 1024) // max(1, len(page)))
    elif size == "over":
        page = b"# " + b"m" * (17 * 1024 * 1024) + b"\n"
    if draw(ints(0, 9)) == 0:
        reply, _ = draw(labelled_replies(stream=False))
        return reply
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(page)
    return Reply((head + page,))


# -- KV events ---------------------------------------------------------------------------------

_GOOD_BLOCK = 16


def _hashes(draw: st.DrawFn, count: int) -> list[Any]:
    start = draw(ints(0, 2**64 - 1 - count))
    kind = draw(pick(["int"] * 6 + ["bytes", "mixed", "junk"]))
    if kind == "int":
        return list(range(start, start + count))
    if kind == "bytes":
        return [i.to_bytes(32, "big") for i in range(start, start + count)]
    if kind == "mixed":
        return [i if i % 2 else str(i) for i in range(start, start + count)]
    return [draw(json_values()) for _ in range(min(count, 4))]


@st.composite
def kv_events(draw: st.DrawFn) -> Any:
    """One event, as vLLM writes it (a tagged map, or an older positional array), or not."""
    kind = draw(pick(["stored"] * 4 + ["removed", "cleared", "junk"]))
    if kind == "junk":
        return draw(json_values())
    if kind == "cleared":
        return {"type": "AllBlocksCleared"}
    count = draw(pick([1, 2, 8, 100] * 4 + [5_000]))
    if kind == "removed":
        return {"type": "BlockRemoved", "block_hashes": _hashes(draw, count), "medium": "GPU"}
    block_size = draw(pick([_GOOD_BLOCK] * 6 + [32, 0, -16, 7, 2**40]))
    tokens = draw(pick(["whole", "short", "junk"]))
    if tokens == "whole" and 0 < block_size <= 64:
        ids: Any = list(range(count * block_size))
    elif tokens == "short":
        ids = list(range(max(0, count * 3)))
    else:
        ids = draw(json_values())
    event = {
        "type": "BlockStored",
        "block_hashes": _hashes(draw, count),
        "parent_block_hash": draw(st.one_of(st.none(), ints(0, 2**64 - 1), json_values())),
        "token_ids": ids,
        "block_size": block_size,
        "lora_id": None,
        "medium": draw(pick(["GPU", "CPU", None, 5])),
    }
    if draw(ints(0, 4)) == 0:
        return ["BlockStored", *list(event.values())[1:]]
    return event


@st.composite
def kv_messages(draw: st.DrawFn) -> tuple[bytes, ...]:
    """One ZMQ message (its frames). The sequence frame is filled in by the publisher
    unless the message sets its own (``seq_override``-style frames: a jump, a step back,
    the end-of-replay marker, a frame that is not 8 bytes)."""
    events = draw(st.lists(kv_events(), max_size=4))
    payload_kind = draw(pick(["batch"] * 8 + ["junk", "cut", "huge", "not_list"]))
    if payload_kind == "batch":
        payload = msgspec.msgpack.encode([1.0, events, draw(pick([0, None, 3, "x"]))])
    elif payload_kind == "junk":
        payload = draw(st.binary(max_size=64))
    elif payload_kind == "cut":
        whole = msgspec.msgpack.encode([1.0, events, 0])
        payload = whole[: draw(ints(0, len(whole)))]
    elif payload_kind == "huge":
        payload = msgspec.msgpack.encode([1.0, [], 0]) + b"\x00" * (17 * 1024 * 1024)
    else:
        payload = msgspec.msgpack.encode({"ts": 1.0, "events": events})
    seq = draw(pick([b"next"] * 8 + [b"jump", b"back", b"end", b"short"]))
    frames = draw(pick(["three"] * 10 + ["one", "two", "five"]))
    if frames == "one":
        return (payload,)
    if frames == "two":
        return (seq, payload)
    if frames == "five":
        return (b"", seq, payload, b"x", b"y")
    return (b"", seq, payload)


@st.composite
def engine_cases(draw: st.DrawFn) -> EngineCase:
    stream = draw(st.booleans())
    reply, labels = draw(labelled_replies(stream))
    metrics = draw(st.one_of(st.none(), metrics_pages()))
    messages = tuple(draw(st.lists(kv_messages(), max_size=3)))
    api = draw(pick(["chat"] * 4 + ["completions", "messages", "responses"]))
    return EngineCase(reply, metrics, messages, stream, api, labels)
