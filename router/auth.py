"""Who may use the router: clients by ``api_keys`` on its /v1/ routes, operators by
``metrics_token`` and ``admin_token``, each as ``Authorization: Bearer <secret>``.

The header is compared as the bytes the client sent (aiohttp decodes them with surrogate
escapes, ``router.parse.header_bytes`` undoes that), in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable


def bearers(secrets: Iterable[str]) -> tuple[bytes, ...]:
    """What an ``Authorization`` header carrying one of ``secrets`` is, as bytes."""
    return tuple(f"Bearer {s}".encode() for s in secrets)


def authorized(given: bytes, accepted: Iterable[bytes]) -> bool:
    """``given`` (an Authorization header's bytes) is one of ``accepted``."""
    return any(hmac.compare_digest(given, a) for a in accepted)
