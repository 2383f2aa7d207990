"""A request as the connection receives it, and the limits every request is held to."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.errors import RouterError

MAX_TARGET_BYTES = 8190
# httptools would buffer an unterminated header without end.
MAX_HEAD_BYTES = 1 << 20


class Refused(Exception):
    """A request the connection answers itself, with ``error``, and closes after."""

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
    coding: bytes = b"identity"  # its body's Content-Encoding
    # The client waits for a 100 Continue before its body, and has not had it yet.
    expects_continue: bool = False
