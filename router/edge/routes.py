"""The one route table: ``(method, path) -> Route``, for every request the router serves.

A ``Route`` names its handler and its ``Guard`` (which credential it needs); the
connection checks the guard, calls the handler and renders whatever ``RouterError`` it
raises, in one place for every route. A handler either answers through the ``Reply`` it
is given (the routes that relay an engine's answer) or returns an ``Answer`` (everything
the router answers itself), which a wrapper can still amend (``Routes.wrap``: the
process group's merged ``/metrics``).

Paths are literal or have ``{name}`` segments, matched one segment each; a GET route
answers HEAD too.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import orjson

from router.edge.reply import Reply
from router.errors import MethodNotAllowed, NotFound
from router.wire.http1 import Headers

if TYPE_CHECKING:
    from router.state import RouterState


class Guard(enum.Enum):
    """Which credential a route needs, when the router is configured with it."""

    OPEN = "open"  # nothing
    CLIENT = "client"  # one of ``api_keys`` (Authorization or x-api-key)
    METRICS = "metrics"  # ``metrics_token``
    ADMIN = "admin"  # ``admin_token``


@dataclass(slots=True)
class Request:
    """One request as its handler reads it: the body whole and decoded."""

    method: str
    path: str  # as sent, without the query
    target: bytes  # as the client sent it, query included
    headers: Sequence[tuple[bytes, bytes]]
    body: bytes
    params: dict[str, str] = field(default_factory=dict)  # the path's {name} segments
    via_socket_path: bool = False  # arrived on a Unix socket (a sibling process)

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower case)."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer the router makes itself."""

    status: int
    body: bytes
    headers: Headers = ((b"Content-Type", b"application/json"),)

    def with_header(self, name: bytes, value: bytes) -> Answer:
        return replace(self, headers=(*self.headers, (name, value)))


def json_answer(body: Any, status: int = 200) -> Answer:
    return Answer(status, orjson.dumps(body))


@dataclass(frozen=True, slots=True)
class Call:
    """What a handler is given."""

    state: RouterState
    request: Request
    reply: Reply


Handler = Callable[[Call], Awaitable[Answer | None]]  # None: it answered through the reply


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    pattern: str  # "/admin/workers/{name}/drain"
    handler: Handler
    guard: Guard


def _segments(pattern: str) -> tuple[str, ...]:
    return tuple(pattern.split("/")[1:])


def _is_param(segment: str) -> bool:
    return segment.startswith("{") and segment.endswith("}")


class Routes:
    """The table. Literal paths are one dict lookup; patterns are tried in order."""

    def __init__(self) -> None:
        self._methods: dict[str, dict[str, Route]] = {}  # pattern -> method -> route
        # The same method tables, as requests look them up: literal paths by the path,
        # the others by their segments.
        self._literal: dict[str, dict[str, Route]] = {}
        self._patterns: list[tuple[tuple[str, ...], dict[str, Route]]] = []

    def add(self, method: str, pattern: str, handler: Handler, guard: Guard) -> None:
        methods = self._methods.get(pattern)
        if methods is None:
            methods = self._methods[pattern] = {}
            segments = _segments(pattern)
            if any(_is_param(s) for s in segments):
                self._patterns.append((segments, methods))
            else:
                self._literal[pattern] = methods
        if method in methods:
            raise ValueError(f"{method} {pattern} is routed twice")
        methods[method] = Route(method, pattern, handler, guard)

    def wrap(self, method: str, pattern: str, wrapper: Callable[[Handler], Handler]) -> None:
        """Route ``method pattern`` through ``wrapper(its handler)``."""
        methods = self._methods.get(pattern, {})
        route = methods.get(method)
        if route is None:
            raise KeyError(f"{method} {pattern} is not routed")
        methods[method] = replace(route, handler=wrapper(route.handler))

    def match(self, method: str, path: str) -> tuple[Route, dict[str, str]]:
        """The route of ``path`` (as sent, without its query) and its parameters;
        ``NotFound`` or ``MethodNotAllowed``."""
        methods = self._literal.get(path)
        params: dict[str, str] = {}
        if methods is None:
            methods, params = self._by_pattern(path)
        route = methods.get(method)
        if route is None and method == "HEAD":
            route = methods.get("GET")
        if route is not None:
            return route, params
        if methods:
            raise MethodNotAllowed(method, sorted(methods))
        raise NotFound(f"no route for {method} {unquote(path)}")

    def _by_pattern(self, path: str) -> tuple[dict[str, Route], dict[str, str]]:
        parts = path.split("/")[1:]
        for segments, methods in self._patterns:
            if len(segments) != len(parts):
                continue
            params: dict[str, str] = {}
            for segment, part in zip(segments, parts, strict=True):
                if _is_param(segment):
                    if not part:
                        break
                    params[segment[1:-1]] = unquote(part)
                elif segment != unquote(part):
                    break
            else:
                return methods, params
        return {}, {}
