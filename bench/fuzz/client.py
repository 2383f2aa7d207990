"""A raw HTTP/1.1 client for fuzzing the router, and the properties every answer must keep.

Requests are written as bytes (any method, target, header name and value, body), so
nothing is validated or re-encoded on the client side; the answer is read with
``http.client``'s response parser, which handles lengths, chunking and ``100 Continue``.
Blocking sockets: the fuzz drivers call it from a worker thread or a plain loop.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

# Status codes ``send`` reports when there was no HTTP answer at all.
NO_ANSWER = 0  # the connection closed (or reset) before a status line
TIMED_OUT = -1  # nothing within the timeout
REFUSED = -2  # no connection: the server is gone
MAX_ANSWER_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class RawRequest:
    method: bytes
    target: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes = b""
    chunked: bool = False  # Transfer-Encoding: chunked instead of Content-Length

    def encode(self) -> bytes:
        lines = [self.method + b" " + self.target + b" HTTP/1.1", b"Host: fuzz"]
        lines += [name + b": " + value for name, value in self.headers]
        if self.chunked:
            lines.append(b"Transfer-Encoding: chunked")
            body = (
                b"%x\r\n%s\r\n0\r\n\r\n" % (len(self.body), self.body)
                if self.body
                else b"0\r\n\r\n"
            )
        else:
            lines.append(b"Content-Length: %d" % len(self.body))
            body = self.body
        lines.append(b"Connection: close")
        return b"\r\n".join(lines) + b"\r\n\r\n" + body


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    content_type: str
    body: bytes
    cut: bool = False  # the connection ended before the body did


def send(host: str, port: int, request: RawRequest, timeout_s: float) -> Answer:
    """One request on a new connection; a status of ``NO_ANSWER`` or ``TIMED_OUT`` when
    no HTTP answer came back."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            # The router may answer (413, 400) and close before reading the whole body.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(request.encode())
            return _read_answer(sock, request.method)
    except TimeoutError:
        return Answer(TIMED_OUT, "", b"")
    except ConnectionRefusedError:
        return Answer(REFUSED, "", b"")


def _read_answer(sock: socket.socket, method: bytes) -> Answer:
    response = http.client.HTTPResponse(sock, method=method.decode("latin-1"))
    try:
        try:
            response.begin()
        except (http.client.HTTPException, ConnectionResetError):
            return Answer(NO_ANSWER, "", b"")
        content_type = response.headers.get("Content-Type", "")
        try:
            body = response.read(MAX_ANSWER_BYTES)
        except http.client.IncompleteRead as exc:
            return Answer(response.status, content_type, exc.partial, cut=True)
        except (http.client.HTTPException, ConnectionResetError):
            return Answer(response.status, content_type, b"", cut=True)
    finally:
        response.close()
    return Answer(response.status, content_type, body)


def is_parser_rejection(answer: Answer) -> bool:
    """aiohttp answers what its HTTP parser refuses (a bad method, target or header, a
    duplicated singleton header, an encoding it cannot decode) itself, before the app
    sees a request: a plain-text 400. Every answer of the app is JSON."""
    return answer.status == 400 and answer.content_type.startswith("text/plain")


def _is_openai_error(body: bytes) -> bool:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
    )


def violation(request: RawRequest, answer: Answer) -> str | None:
    """What is wrong with ``answer``, or None: no HTTP answer, a 500, or an error without
    an OpenAI-shaped JSON body (except aiohttp's own parser rejections, and HEAD, which
    has no body)."""
    if answer.status == NO_ANSWER:
        return "no answer"
    if answer.status == TIMED_OUT:
        return "timed out"
    if answer.status == REFUSED:
        return "connection refused"
    if answer.status == 500:
        return "500"
    if answer.cut:
        return f"{answer.status} whose body was cut short"
    if answer.status < 400 or request.method.upper() == b"HEAD" or is_parser_rejection(answer):
        return None
    if not answer.content_type.startswith("application/json"):
        return f"{answer.status} with a {answer.content_type or 'untyped'} body"
    if not _is_openai_error(answer.body):
        return f"{answer.status} without an OpenAI-shaped error body"
    return None


def status_label(answer: Answer) -> str:
    if answer.status == NO_ANSWER:
        return "no answer"
    if answer.status == TIMED_OUT:
        return "timeout"
    if answer.status == REFUSED:
        return "refused"
    if is_parser_rejection(answer):
        return "400 (HTTP parser)"
    return str(answer.status)


def normal_chat(api_key: str, model: str) -> RawRequest:
    """A well-formed chat request, as a client that means no harm sends it."""
    body = orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "hello after the fuzz"}],
            "max_tokens": 4,
            "ignore_eos": True,
        }
    )
    return RawRequest(
        b"POST",
        b"/v1/chat/completions",
        _headers(("Content-Type", "application/json"), ("Authorization", f"Bearer {api_key}")),
        body,
    )


def _headers(*pairs: tuple[str, str]) -> tuple[tuple[bytes, bytes], ...]:
    return tuple((name.encode(), value.encode()) for name, value in pairs)


def describe(request: RawRequest, limit: int = 300) -> str:
    """A short printable form of a request, for reports of violations."""
    lines: Sequence[bytes] = request.encode().split(b"\r\n\r\n", 1)
    head = lines[0][:limit]
    body = request.body[:limit]
    return f"{head!r} body[{len(request.body)}]={body!r}"
