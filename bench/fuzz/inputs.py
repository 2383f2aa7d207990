"""Hypothesis strategies for hostile requests: bodies, headers, methods and targets.

Bodies start as valid-ish OpenAI chat and completion requests whose fields are swapped
for values of the wrong type, strings that are huge or non-ASCII, nesting past every
limit, and then are cut, spliced, re-encoded or replaced by random bytes. JSON that a
serializer will not write (lone surrogates, numbers past a double, deep nesting) enters
as marker strings replaced in the serialized text. Headers carry bytes that are not
UTF-8 (aiohttp hands them over as surrogate escapes) in the fields the router reads.

Body framing is left well formed (the length is always right, or the body is chunked):
a wrong length is a slow client, not a hostile body, and has tests of its own.
"""

from __future__ import annotations

import dataclasses
import gzip
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any
from urllib.parse import quote

import orjson
from hypothesis import strategies as st

from bench.fuzz.client import RawRequest
from policies.registry import policy_class, policy_names

Strategy = st.SearchStrategy

# Serialized as JSON strings, then replaced by text no serializer writes.
_MARKERS: dict[str, bytes] = {
    "\x00lone-high\x00": b'"\\ud800"',
    "\x00lone-low\x00": b'"a\\udc80b"',
    "\x00pair\x00": b'"\\ud83d\\ude00"',
    "\x00nul\x00": b'"a\\u0000b"',
    "\x00huge-int\x00": b"1" * 400,
    "\x00big-float\x00": b"1e400",
    "\x00nan\x00": b"NaN",
    "\x00minus-inf\x00": b"-Infinity",
    "\x00u64-max\x00": b"18446744073709551615",
    "\x00past-u64\x00": b"18446744073709551616",
    "\x00i64-min\x00": b"-9223372036854775808",
    "\x00deep-255\x00": b"[" * 255 + b"]" * 255,
    "\x00deep-256\x00": b"[" * 256 + b"]" * 256,
    "\x00deep-1100\x00": b"[" * 1100 + b"]" * 1100,
    "\x00deep-obj\x00": b'{"a":' * 300 + b"1" + b"}" * 300,
    "\x00deep-open\x00": b"[" * 5000,
}
_REPLACEMENTS = tuple((orjson.dumps(marker), text) for marker, text in _MARKERS.items())
_MARKER_STRINGS = st.sampled_from(sorted(_MARKERS))
BOMB_BYTES = 16 * 1024 * 1024  # zeros, sent compressed: a few KiB on the wire
ROLES = ("user", "system", "assistant", "tool", "developer")


@dataclass(frozen=True, slots=True)
class Target:
    """The router under fuzz: its credentials, model, and which workers the fuzz may
    add and remove through the admin API (never the ones serving)."""

    api_key: str
    admin_token: str
    model: str
    serving: tuple[str, ...] = ("w0",)
    spare: tuple[str, ...] = ("f0", "f1", "f2")
    # Added workers point here: a loopback port nothing listens on (no lookups, no waits).
    spare_url: str = "http://127.0.0.1:9"


# -- JSON ----------------------------------------------------------------------------------


def strings(huge: bool = True) -> Strategy[str]:
    """Short unicode (no surrogates: see the markers), markers, and (``huge``) long
    repeats: at most 120,000 characters, so a body stays within a few MiB."""
    short = st.one_of(
        st.text(max_size=24), st.text(st.characters(codec="ascii"), max_size=8), _MARKER_STRINGS
    )
    if not huge:
        return short
    repeated = st.tuples(st.text(min_size=1, max_size=6), st.sampled_from([200, 20_000]))
    return st.one_of(short, short, repeated.map(lambda t: t[0] * t[1]))


def _scalars() -> Strategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        strings(huge=False),
    )


@cache
def json_values() -> Strategy[Any]:
    return st.recursive(
        _scalars(),
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=10,
    )


def _or_junk(good: Strategy[Any]) -> Strategy[Any]:
    """Mostly ``good``; now and then any JSON value (wrong type included)."""
    return st.one_of(good, good, good, json_values())


def _repeated(item: Strategy[list[Any]], counts: tuple[int, ...]) -> Strategy[list[Any]]:
    """``item`` repeated: long arrays at the cost of drawing a few elements."""
    return st.tuples(item, st.sampled_from(counts)).map(lambda t: t[0] * t[1])


def serialize(value: Any) -> bytes:
    raw = orjson.dumps(value)
    for marker, text in _REPLACEMENTS:
        if marker in raw:
            raw = raw.replace(marker, text)
    return raw


# -- bodies --------------------------------------------------------------------------------


def _parts() -> Strategy[Any]:
    text = st.fixed_dictionaries({"type": st.just("text"), "text": strings()})
    image = st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": strings()})}
    )
    return st.one_of(text, text, image)


def _valid_messages() -> Strategy[list[dict[str, Any]]]:
    content = st.one_of(strings(), st.lists(_parts(), min_size=1, max_size=3))
    message = st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": content})
    return st.lists(message, min_size=1, max_size=4)


def _hostile_messages() -> Strategy[Any]:
    """Wrong types at every level, tool calls of any shape, and more messages and
    content parts than the caps allow (many small ones: cheap to draw)."""
    content = st.one_of(
        strings(),
        st.none(),
        st.lists(st.one_of(_parts(), json_values()), max_size=4),
        json_values(),
    )
    message = st.fixed_dictionaries(
        {"role": _or_junk(st.sampled_from(ROLES)), "content": content},
        optional={"name": json_values(), "tool_calls": json_values(), "tool_call_id": strings()},
    )
    few = st.lists(_or_junk(message), min_size=1, max_size=4)
    small = st.fixed_dictionaries(
        {
            "role": st.sampled_from(ROLES),
            "content": st.one_of(st.text(max_size=8), st.just([{"type": "text", "text": "x"}])),
        }
    )
    many = _repeated(st.lists(small, min_size=1, max_size=3), (30, 3000, 10_001))
    return st.one_of(few, few, many, json_values())


def _common() -> dict[str, Strategy[Any]]:
    """Optional fields both kinds carry, valid; small token budgets keep engines quick."""
    return {
        "max_tokens": st.integers(1, 8),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "ignore_eos": st.booleans(),
        "session_id": strings(),
        "user": strings(),
        "cache_salt": strings(),
        "temperature": st.floats(0, 2),
    }


_FIELDS = (
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "stream",
    "stream_options",
    "user",
    "session_id",
    "cache_salt",
    "n",
    "max_completion_tokens",
    "min_tokens",
    "tools",
)


@st.composite
def _mutate_fields(draw: st.DrawFn, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with up to two fields set to any JSON value or removed (none a third of
    the time: valid requests, which reach an engine, are drawn too)."""
    body = dict(body)
    for _ in range(draw(st.sampled_from([0, 1, 2]))):
        name = draw(st.sampled_from(sorted(set(body) | set(_FIELDS))))
        if draw(st.integers(0, 3)):
            body[name] = draw(json_values())
        else:
            body.pop(name, None)
    return body


def _model(model: str) -> Strategy[Any]:
    return st.one_of(st.just(model), st.just(model), st.just(model), strings())


def chat_bodies(model: str) -> Strategy[dict[str, Any]]:
    messages = st.one_of(_valid_messages(), _valid_messages(), _hostile_messages())
    return st.fixed_dictionaries(
        {"model": _model(model), "messages": messages}, optional=_common()
    ).flatmap(_mutate_fields)


def _prompts() -> Strategy[Any]:
    ids = st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=16)
    few_ids = st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=4)
    return st.one_of(
        strings(),
        strings(),
        st.lists(strings(), max_size=3),
        ids,
        _repeated(few_ids, (1000, 50_000)),
        st.lists(st.one_of(st.integers(-(2**63), 2**64 - 1), st.booleans()), max_size=6),
        st.lists(ids, max_size=3),
        json_values(),
    )


def completion_bodies(model: str) -> Strategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"model": _model(model), "prompt": _prompts()}, optional=_common()
    ).flatmap(_mutate_fields)


def _anthropic_blocks() -> Strategy[Any]:
    text = st.fixed_dictionaries({"type": st.just("text"), "text": strings()})
    tool_use = st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": strings(), "name": strings(), "input": json_values()}
    )
    tool_result = st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": strings(), "content": json_values()}
    )
    image = st.fixed_dictionaries({"type": st.just("image"), "source": json_values()})
    return st.one_of(text, text, tool_use, tool_result, image, json_values())


def messages_bodies(model: str) -> Strategy[dict[str, Any]]:
    """Anthropic Messages bodies: system and content blocks of every kind, wrong types."""
    content = st.one_of(strings(), st.lists(_anthropic_blocks(), max_size=4), json_values())
    message = st.fixed_dictionaries(
        {"role": _or_junk(st.sampled_from(("user", "assistant", "system"))), "content": content}
    )
    return st.fixed_dictionaries(
        {
            "model": _model(model),
            "max_tokens": st.integers(1, 8),
            "messages": st.one_of(st.lists(_or_junk(message), max_size=4), json_values()),
        },
        optional={
            "system": st.one_of(strings(), st.lists(_anthropic_blocks(), max_size=3)),
            "stream": st.booleans(),
            "tools": json_values(),
            "tool_choice": json_values(),
            "metadata": st.one_of(st.fixed_dictionaries({"user_id": strings()}), json_values()),
            "ignore_eos": st.booleans(),
        },
    ).flatmap(_mutate_fields)


def _responses_items() -> Strategy[Any]:
    message = st.fixed_dictionaries(
        {
            "role": _or_junk(st.sampled_from(("user", "assistant", "system", "developer"))),
            "content": st.one_of(
                strings(),
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(("input_text", "output_text")), "text": strings()}
                    ),
                    max_size=3,
                ),
                json_values(),
            ),
        },
        optional={"type": st.just("message")},
    )
    call = st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": strings(),
            "name": strings(),
            "arguments": json_values(),
        }
    )
    output = st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": strings(), "output": json_values()}
    )
    reasoning = st.fixed_dictionaries({"type": st.just("reasoning"), "summary": json_values()})
    return st.one_of(message, message, call, output, reasoning, json_values())


def responses_bodies(model: str) -> Strategy[dict[str, Any]]:
    """OpenAI Responses bodies: instructions, input items of every kind, wrong types,
    continuations of responses nobody stored."""
    return st.fixed_dictionaries(
        {
            "model": _model(model),
            "input": st.one_of(strings(), st.lists(_responses_items(), max_size=4), json_values()),
        },
        optional={
            "instructions": st.one_of(strings(), json_values()),
            "max_output_tokens": st.integers(1, 8),
            "stream": st.booleans(),
            "store": st.booleans(),
            "tools": json_values(),
            "previous_response_id": st.one_of(strings(), json_values()),
            "prompt_cache_key": strings(),
            "ignore_eos": st.booleans(),
        },
    ).flatmap(_mutate_fields)


@st.composite
def _mutated(draw: st.DrawFn, raw: bytes) -> bytes:
    """``raw`` cut, spliced or re-encoded somewhere."""
    at = draw(st.integers(0, len(raw)))
    how = draw(st.sampled_from(["cut", "insert", "replace", "bom", "utf16", "latin1", "trail"]))
    if how == "cut":
        return raw[:at]
    if how == "insert":
        return raw[:at] + draw(st.binary(min_size=1, max_size=8)) + raw[at:]
    if how == "replace" and raw:
        at = min(at, len(raw) - 1)
        return raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1 :]
    if how == "bom":
        return b"\xef\xbb\xbf" + raw
    text = raw.decode("utf-8", "replace")
    if how == "utf16":
        return text.encode("utf-16")
    if how == "latin1":
        return text.encode("latin-1", "replace")
    return raw + draw(st.sampled_from([b" ", b"\x00", b"}", b"{}", b"\n\n[1]"]))


_ODD_BODIES = (b"", b"null", b"[]", b"{}", b'"x"', b"1", b"{", b"\x00", b" " * 1000)


def bodies(fields: Strategy[dict[str, Any]]) -> Strategy[bytes]:
    serialized = fields.map(serialize)
    return st.one_of(
        serialized,
        serialized,
        serialized,
        serialized.flatmap(_mutated),
        st.binary(max_size=64),
        st.sampled_from(_ODD_BODIES),
    )


# -- headers -------------------------------------------------------------------------------

_NOT_LINE_ENDS = bytes(b for b in range(256) if b not in b"\r\n")


def header_values() -> Strategy[bytes]:
    """Printable ASCII, UTF-8, latin-1 and bytes that are not UTF-8; controls; long.
    Never a line end: that would be another header, not a value."""
    return st.one_of(
        st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(str.encode),
        st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=16).map(
            str.encode
        ),
        st.binary(min_size=1, max_size=12).map(lambda b: bytes(0x80 | c for c in b)),
        st.binary(max_size=16).map(lambda b: bytes(_NOT_LINE_ENDS[c % 254] for c in b)),
        st.sampled_from(
            [
                b"\xff",
                b"\xc3\x28",
                b"\xed\xa0\x80",
                b"\xf4\x90\x80\x80",
                b"\x00",
                b"\x7f",
                b"\t",
                b" ",
                b"\r",
                b"",
            ]
        ),
        st.sampled_from([100, 8000, 8190, 9000]).map(lambda n: b"a" * n),
    )


def _bearer(token: str) -> Strategy[bytes]:
    right = b"Bearer " + token.encode()
    return st.one_of(
        st.just(right),
        st.just(right),
        header_values().map(lambda v: right + v),
        header_values().map(lambda v: b"Bearer " + v),
        st.sampled_from([right.lower(), b"Bearer  " + token.encode(), b"Basic " + token.encode()]),
        header_values(),
    )


_ENCODINGS = (
    b"gzip",
    b"deflate",
    b"br",
    b"zstd",
    b"identity",
    b"gzip, deflate",
    b"x-gzip",
    b"compress",
    b"GZIP",
    b"gzip;q=1",
)
_CONTENT_TYPES = (
    b"application/json",
    b"application/json; charset=latin-1",
    b"text/plain",
    b"multipart/form-data; boundary=x",
    b"application/x-www-form-urlencoded",
    b"application/json; charset=\xff",
)
_NAMES = (
    b"X-Session-Id",
    b"Content-Type",
    b"Content-Encoding",
    b"Accept",
    b"Accept-Encoding",
    b"User-Agent",
    b"X-Request-Id",
    b"traceparent",
    b"tracestate",
    b"baggage",
    b"Cookie",
    b"Expect",
    b"Connection",
    b"Upgrade",
    b"Authorization",
    b"X-Kvrouter-Worker",
    b"Proxy-Authorization",
    b"Origin",
    b"Range",
    b"If-None-Match",
)


def header_names() -> Strategy[bytes]:
    return st.one_of(
        st.sampled_from(_NAMES),
        st.sampled_from(_NAMES).map(bytes.lower),
        st.binary(min_size=1, max_size=12).map(lambda b: bytes(_NOT_LINE_ENDS[c % 254] for c in b)),
    )


def _extra_header() -> Strategy[tuple[bytes, bytes]]:
    return st.one_of(
        st.tuples(header_names(), header_values()),
        st.tuples(st.just(b"Content-Encoding"), st.sampled_from(_ENCODINGS) | header_values()),
        st.tuples(st.just(b"Content-Type"), st.sampled_from(_CONTENT_TYPES) | header_values()),
        st.tuples(st.just(b"X-Session-Id"), header_values()),
    )


@st.composite
def hostile_headers(draw: st.DrawFn, token: str) -> tuple[tuple[bytes, bytes], ...]:
    """Content-Type and Authorization as a client sends them (or not, or mangled), then
    extras of any name and value."""
    base: list[tuple[bytes, bytes]] = []
    if draw(st.integers(0, 5)):
        base.append((b"Content-Type", b"application/json"))
    if draw(st.integers(0, 5)):
        base.append((b"Authorization", draw(_bearer(token))))
    return (*base, *draw(st.lists(_extra_header(), min_size=1, max_size=3)))


def _session_ids() -> Strategy[bytes]:
    """Session header values a parser lets through: printable, UTF-8, latin-1."""
    return st.one_of(
        st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40).map(
            str.encode
        ),
        st.text(st.characters(codec="utf-8", min_codepoint=0xA0), min_size=1, max_size=8).map(
            str.encode
        ),
        st.binary(min_size=1, max_size=12).map(lambda b: bytes(0x80 | c for c in b)),
    )


@st.composite
def clean_headers(draw: st.DrawFn, token: str) -> tuple[tuple[bytes, bytes], ...]:
    """What a well-behaved client sends, so that the body is what gets tested."""
    base = ((b"Content-Type", b"application/json"), (b"Authorization", b"Bearer " + token.encode()))
    if draw(st.booleans()):
        return (*base, (b"X-Session-Id", draw(_session_ids())))
    return base


@cache
def _bombs() -> tuple[bytes, bytes]:
    zeros = bytes(BOMB_BYTES)
    return gzip.compress(zeros), zlib.compress(zeros)


def _encode_body(body: bytes, how: str) -> tuple[tuple[bytes, bytes], bytes]:
    gzip_bomb, deflate_bomb = _bombs()
    table: dict[str, tuple[bytes, Callable[[], bytes]]] = {
        "gzip": (b"gzip", lambda: gzip.compress(body)),
        "deflate": (b"deflate", lambda: zlib.compress(body)),
        "gzip-bomb": (b"gzip", lambda: gzip_bomb),
        "deflate-bomb": (b"deflate", lambda: deflate_bomb),
    }
    name, encode = table[how]
    return (b"Content-Encoding", name), encode()


@st.composite
def _framed(
    draw: st.DrawFn,
    method: bytes,
    target: bytes,
    token: str,
    body: Strategy[bytes],
    hostile: bool = False,
) -> RawRequest:
    raw = draw(body)
    hdrs = draw(hostile_headers(token) if hostile else clean_headers(token))
    how = draw(st.sampled_from(["plain"] * 28 + ["gzip", "deflate", "gzip-bomb", "deflate-bomb"]))
    if how != "plain":
        header, raw = _encode_body(raw, how)
        hdrs = (*hdrs, header)
    return RawRequest(method, target, hdrs, raw, chunked=draw(st.integers(0, 9)) == 0)


# -- requests ------------------------------------------------------------------------------


def chat_requests(target: Target, hostile_headers: bool = False) -> Strategy[RawRequest]:
    body = bodies(chat_bodies(target.model))
    return _framed(b"POST", b"/v1/chat/completions", target.api_key, body, hostile_headers)


def completion_requests(target: Target) -> Strategy[RawRequest]:
    body = bodies(completion_bodies(target.model))
    return _framed(b"POST", b"/v1/completions", target.api_key, body)


def messages_requests(target: Target) -> Strategy[RawRequest]:
    body = bodies(messages_bodies(target.model))
    return _framed(b"POST", b"/v1/messages", target.api_key, body)


def responses_requests(target: Target) -> Strategy[RawRequest]:
    body = bodies(responses_bodies(target.model))
    return _framed(b"POST", b"/v1/responses", target.api_key, body)


def _path_segment(names: Strategy[str]) -> Strategy[bytes]:
    return names.map(lambda n: quote(n.encode("utf-8", "surrogatepass"), safe="").encode())


def _knobs() -> Strategy[dict[str, Any]]:
    names = sorted(
        {f.name for p in policy_names() for f in dataclasses.fields(policy_class(p).params_type)}
    )
    return st.dictionaries(st.sampled_from(names) | st.text(max_size=8), json_values(), max_size=3)


def _admin_calls(target: Target) -> Strategy[tuple[bytes, bytes, Strategy[dict[str, Any]]]]:
    """(method, path, body fields) of admin calls; serving workers are never drained or
    removed, so the fleet still serves when the fuzz is over."""
    names = st.one_of(st.sampled_from(target.spare), st.text(max_size=12)).filter(
        lambda n: n not in target.serving
    )
    any_name = st.one_of(names, st.sampled_from(target.serving))
    segment = _path_segment(names)
    worker = st.fixed_dictionaries(
        {},
        optional={
            "url": _or_junk(st.sampled_from([target.spare_url, target.spare_url + "/"])),
            "name": _or_junk(st.sampled_from(target.spare)),
            "kv_tokens": _or_junk(st.integers(1, 10**6)),
        },
    )
    policy = st.fixed_dictionaries(
        {},
        optional={
            "policy": _or_junk(st.sampled_from(policy_names())),
            "knobs": _or_junk(_knobs()),
            "extra": json_values(),
        },
    )
    migrate = st.fixed_dictionaries({}, optional={"to": _or_junk(any_name)})
    empty: Strategy[dict[str, Any]] = st.just({})
    return st.one_of(
        st.tuples(st.just(b"GET"), st.just(b"/admin/workers"), st.just(empty)),
        st.tuples(st.just(b"POST"), st.just(b"/admin/workers"), st.just(worker)),
        segment.map(lambda s: (b"DELETE", b"/admin/workers/" + s, empty)),
        segment.flatmap(
            lambda s: st.sampled_from([b"POST", b"DELETE"]).map(
                lambda m: (m, b"/admin/workers/" + s + b"/drain", empty)
            )
        ),
        segment.map(lambda s: (b"POST", b"/admin/workers/" + s + b"/migrate", migrate)),
        st.tuples(st.just(b"GET"), st.just(b"/admin/policy"), st.just(empty)),
        st.tuples(st.just(b"PUT"), st.just(b"/admin/policy"), st.just(policy)),
    )


def admin_requests(target: Target, hostile_headers: bool = False) -> Strategy[RawRequest]:
    return _admin_calls(target).flatmap(
        lambda call: _framed(call[0], call[1], target.admin_token, bodies(call[2]), hostile_headers)
    )


_METHODS = (
    b"GET",
    b"POST",
    b"PUT",
    b"DELETE",
    b"PATCH",
    b"HEAD",
    b"OPTIONS",
    b"TRACE",
    b"CONNECT",
    b"get",
    b"PRI",
    b"PROPFIND",
    b"M-SEARCH",
)
_PATHS = (
    b"/v1/chat/completions",
    b"/v1/completions",
    b"/v1/responses",
    b"/v1/responses/resp_0",
    b"/v1/responses/resp_0/cancel",
    b"/v1/messages",
    b"/v1/messages/count_tokens",
    b"/tokenize",
    b"/detokenize",
    b"/v1/models",
    b"/health",
    b"/ready",
    b"/metrics",
    b"/admin/workers",
    b"/admin/policy",
    b"/admin/workers/f0/drain",
    b"/",
    b"/v1/",
    b"/v1/embeddings",
    b"/admin/",
)
_SUFFIXES = (
    b"",
    b"/",
    b"?x=1",
    b"%ff",
    b"%00",
    b"/..",
    b"//",
    b"?%ff=%fe",
    b"#frag",
    b"/%2e%2e/metrics",
    b";x",
    b"%",
)


def methods() -> Strategy[bytes]:
    token = st.text(
        st.characters(codec="ascii", categories=["Lu", "Ll"]), min_size=1, max_size=10
    ).map(str.encode)
    junk = st.binary(min_size=1, max_size=10).map(
        lambda b: bytes(_NOT_LINE_ENDS[c % 254] for c in b)
    )
    return st.one_of(st.sampled_from(_METHODS), st.sampled_from(_METHODS), token, junk)


def targets() -> Strategy[bytes]:
    known = st.tuples(st.sampled_from(_PATHS), st.sampled_from(_SUFFIXES)).map(b"".join)
    return st.one_of(
        known,
        known,
        _path_segment(st.text(max_size=16)).map(lambda s: b"/" + s),
        st.binary(max_size=24).map(lambda b: b"/" + bytes(_NOT_LINE_ENDS[c % 254] for c in b)),
        st.sampled_from([b"*", b"http://fuzz/v1/models", b"//v1/models", b""]),
        st.sampled_from([8000, 9000]).map(lambda n: b"/" + b"a" * n),  # past the line limit
    )


def wild_requests(target: Target) -> Strategy[RawRequest]:
    """Any method on any target, with whichever credential, headers and body."""
    token = st.sampled_from([target.api_key, target.admin_token])
    body = st.one_of(st.just(b""), bodies(chat_bodies(target.model)))
    return st.tuples(methods(), targets(), token, st.booleans()).flatmap(
        lambda t: _framed(t[0], t[1], t[2], body, t[3])
    )


def requests(target: Target) -> Strategy[RawRequest]:
    """Bodies (behind clean headers), headers, admin calls, methods and targets."""
    return st.one_of(
        chat_requests(target),
        completion_requests(target),
        chat_requests(target, hostile_headers=True),
        admin_requests(target),
        admin_requests(target, hostile_headers=True),
        wild_requests(target),
    )


# Strategies drawn inside composites, built once per distinct argument: building one
# anew at every draw cost more than the draw (validation of the whole tree).
@lru_cache(maxsize=4096)
def _picked(options: tuple[Any, ...]) -> Strategy[Any]:
    return st.sampled_from(options)


def pick(options: Any) -> Strategy[Any]:
    """``st.sampled_from(options)``, built once per distinct ``options``."""
    return _picked(tuple(options))


@lru_cache(maxsize=4096)
def ints(low: int | None = None, high: int | None = None) -> Strategy[int]:
    """``st.integers(low, high)``, built once per distinct bounds."""
    return st.integers(low, high)
