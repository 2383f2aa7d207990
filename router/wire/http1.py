"""HTTP/1.1 responses as bytes, for the router's own server (``router.edge``).

The facts of the wire in one place: status lines, header blocks, chunked framing and the
Date header. Header names and values are bytes as they came from the worker (or as the
router made them), never re-encoded.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Sequence
from http import HTTPStatus

Headers = Sequence[tuple[bytes, bytes]]

# A message head's limits, the router's whichever side sends it (a client or a worker).
MAX_FIELD_BYTES = 8190  # a header's name or value
MAX_HEADERS = 128

_STATUS_LINES: dict[int, bytes] = {
    int(s): b"HTTP/1.1 %d %s\r\n" % (s, s.phrase.encode()) for s in HTTPStatus
}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d Unknown\r\n" % status


class _DateHeader:
    """The Date header's value, formatted once a second (RFC 9110 IMF-fixdate)."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = email.utils.formatdate(now, usegmt=True).encode()
        return self._value


http_date = _DateHeader()


def head(status: int, headers: Headers, framing: bytes, close: bool) -> bytes:
    """A response's status line and headers, ``framing`` (a Content-Length or a
    Transfer-Encoding line) last; a Date is added if the headers carry none (a proxy
    that forwards a response without one must, RFC 9110 §6.6.1)."""
    lines = [status_line(status)]
    dated = False
    for name, value in headers:
        lines.append(b"%s: %s\r\n" % (name, value))
        dated = dated or name.lower() == b"date"
    if not dated:
        lines.append(b"Date: %s\r\n" % http_date())
    if close:
        lines.append(b"Connection: close\r\n")
    lines.append(framing)
    lines.append(b"\r\n")
    return b"".join(lines)


def content_length(length: int) -> bytes:
    return b"Content-Length: %d\r\n" % length


CHUNKED = b"Transfer-Encoding: chunked\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)
