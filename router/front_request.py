"""A request as the router's own server (router.front) receives it: the limits it is
held to, the shapes the front serves itself, and its bytes for the aiohttp app when the
front hands it on."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import compression_utils

from router.apis.kinds import KIND_OF_PATH
from router.auth import accepted_key
from router.errors import RouterError, UnsupportedEncoding
from router.wire.kinds import Kind

MAX_TARGET_BYTES = 8190
MAX_HEAD_BYTES = 1 << 20
HOT_ROUTES: dict[bytes, Kind] = KIND_OF_PATH
_DROPPED_WHEN_BRIDGED = frozenset({b"content-length", b"transfer-encoding", b"expect"})
# The request bodies' Content-Encodings aiohttp decodes here (it would take any other
# body as it is, whatever it claims).
DECODED_CODINGS = frozenset(
    {b"identity", b"gzip", b"deflate"}
    | ({b"br"} if compression_utils.HAS_BROTLI else set())
    | ({b"zstd"} if compression_utils.HAS_ZSTD else set())
)


class Refused(Exception):
    """A request the front answers itself, with ``error``, and closes after."""

    def __init__(self, error: RouterError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(slots=True)
class Message:
    """One request as it arrives."""

    url: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: list[bytes] = field(default_factory=list)
    body_bytes: int = 0
    method: bytes = b""
    version: str = "1.1"
    keep_alive: bool = True
    kind: Kind | None = None  # a hot route in its common shape: served by the front
    # The client waits for a 100 Continue before its body, and has not had it yet.
    expects_continue: bool = False


def undecodable(coding: bytes) -> UnsupportedEncoding:
    known = ", ".join(sorted(c.decode() for c in DECODED_CODINGS))
    return UnsupportedEncoding(
        f"the request's Content-Encoding {coding.decode('latin-1')!r} is not one the router "
        f"decodes ({known})"
    )


def authorized_by(headers: list[tuple[bytes, bytes]], accepted: tuple[bytes, ...]) -> bool:
    """The request carries an accepted key (``router.auth.accepted_key``)."""
    return accepted_key(headers, accepted) is not None


def as_bytes(message: Message) -> bytes:
    """The request as the app is to read it: its body whole, behind a Content-Length
    (the front read the body and answered any Expect)."""
    body = b"".join(message.body)
    lines = [b"%s %s HTTP/%s\r\n" % (message.method, message.url, message.version.encode())]
    lines.extend(
        b"%s: %s\r\n" % (k, v) for k, v in message.headers if k.lower() not in _DROPPED_WHEN_BRIDGED
    )
    lines.append(b"Content-Length: %d\r\n\r\n" % len(body))
    lines.append(body)
    return b"".join(lines)
