"""Which credential each kind of route needs, checked once per request before its handler
runs (``router.edge.routes.Guard``)."""

from __future__ import annotations

from collections.abc import Sequence

from router.auth import accepted_key, authorized, bearers
from router.edge.routes import Guard
from router.errors import Unauthenticated
from router.state import RouterState


def check(guard: Guard, headers: Sequence[tuple[bytes, bytes]], state: RouterState) -> None:
    """Raises ``Unauthenticated`` if the request lacks what ``guard`` asks of it."""
    if guard is Guard.OPEN:
        return
    if guard is Guard.CLIENT:
        accepted = state.accepted_bearers
        if accepted and accepted_key(headers, accepted) is None:
            raise Unauthenticated("missing or invalid API key")
        return
    config = state.config
    token = config.metrics_token if guard is Guard.METRICS else config.admin_token
    if not token:
        return
    given = next((v for k, v in headers if k.lower() == b"authorization"), b"")
    if not authorized(given, bearers([token])):
        what = "invalid metrics token" if guard is Guard.METRICS else "wrong admin bearer token"
        raise Unauthenticated(f"missing or {what}")
