"""A request's session key: read from the first configured source the request carries
(``router.wire.sessions``), kept as a digest with the source's label."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from router.errors import BadRequest
from router.wire.headers import SESSION_END_HEADER
from router.wire.sessions import DEFAULT_SESSION_KEYS, PARENT_SESSION_HEADER, parse_source

NO_SESSION = "none"  # the source label of a request that names no session
_END = SESSION_END_HEADER.lower().encode()
_PARENT = PARENT_SESSION_HEADER.encode()
_END_VALUES = frozenset({b"1", b"true", b"True", b"TRUE"})


@dataclass(frozen=True, slots=True)
class SessionKey:
    # 32 hex digits of xxh3-128 over the key: what the router keeps and hashes per session
    # is the same size whatever the client sent, and never the key itself.
    digest: str
    source: str  # the source's label: "header:x-claude-code-session-id", "body:user", …
    ends: bool = False  # the client marked this its session's last request
    parent: str | None = None  # the digest of the session that spawned it (a subagent's)


class SessionSources:
    """The configured sources, parsed once for the request path."""

    __slots__ = ("header_names", "labels", "order")

    def __init__(self, keys: Sequence[str] = DEFAULT_SESSION_KEYS) -> None:
        # Each source with its header's name as the wire compares it (lower-case bytes).
        self.order = tuple((s, s.name.encode("latin-1")) for s in map(parse_source, keys))
        # The headers the request path collects: the sources', the mark of a session's
        # last request and a subagent's parent.
        self.header_names = frozenset(
            {_END, _PARENT, *(wire for s, wire in self.order if s.kind == "header")}
        )
        # Every label a request can be counted under: a fixed set, for metrics.
        self.labels = (*(s.label for s, _ in self.order), NO_SESSION)

    def find(
        self,
        headers: Mapping[bytes, bytes],
        body: Mapping[str, Any],
        api_session: tuple[str, str] | None,
        max_bytes: int,
        scope: str | None = None,
    ) -> SessionKey | None:
        """The key from the first source the request carries: ``headers`` holds the
        session headers it sent (``header_names``, the first of each name), ``body`` is
        the parsed body, ``api_session`` the API's own session field (its parameter's
        name and value), if set. A key longer than ``max_bytes`` is a ``BadRequest``.
        ``scope`` (the client key's tenant, ``router.auth.tenant``) keeps one client
        key's sessions apart from another's that name the same key."""
        found = self._find(headers, body, api_session, max_bytes)
        if found is None:
            return None
        parent = headers.get(_PARENT)
        parent_digest = (
            _digest(parent, "the parent session header", None, max_bytes) if parent else None
        )
        ends = headers.get(_END) in _END_VALUES
        if scope is None and parent_digest is None and not ends:
            return found
        return SessionKey(
            _scoped(found.digest, scope),
            found.source,
            ends,
            None if parent_digest is None else _scoped(parent_digest, scope),
        )

    def _find(
        self,
        headers: Mapping[bytes, bytes],
        body: Mapping[str, Any],
        api_session: tuple[str, str] | None,
        max_bytes: int,
    ) -> SessionKey | None:
        for source, wire_name in self.order:
            if source.kind == "header":
                value = headers.get(wire_name)
                if value:
                    where = f"the {source.name} header"
                    return SessionKey(_digest(value, where, None, max_bytes), source.label)
            elif source.kind == "body":
                field = body.get(source.name)
                if isinstance(field, str) and field:
                    raw = field.encode()  # orjson parsed it: no surrogates
                    digest = _digest(raw, f"'{source.name}'", source.name, max_bytes)
                    return SessionKey(digest, source.label)
            elif api_session is not None and api_session[1]:
                param, own = api_session
                digest = _digest(own.encode(), f"'{param}'", param, max_bytes)
                return SessionKey(digest, source.label)
        return None


def _scoped(digest: str, scope: str | None) -> str:
    return digest if scope is None else xxhash.xxh3_128_hexdigest(f"{scope}\0{digest}".encode())


def _digest(raw: bytes, where: str, param: str | None, max_bytes: int) -> str:
    if len(raw) > max_bytes:
        raise BadRequest(
            f"the session key in {where} is {len(raw)} bytes; at most {max_bytes} are accepted",
            param=param,
        )
    return xxhash.xxh3_128_hexdigest(raw)
