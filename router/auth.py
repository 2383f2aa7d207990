"""Who may use the router: clients by ``api_keys`` on its /v1/ routes, operators by
``metrics_token`` and ``admin_token``, each as ``Authorization: Bearer <secret>``.

The header is compared as the bytes the client sent (aiohttp decodes them with surrogate
escapes, ``router.apis.request.header_bytes`` undoes that), in constant time.

With ``api_keys``, each key is a tenant: what a request stores through the router (a
Responses response) belongs to the key it presented, named by a digest of it
(``tenant``), and no other key reaches it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable


def bearers(secrets: Iterable[str]) -> tuple[bytes, ...]:
    """What an ``Authorization`` header carrying one of ``secrets`` is, as bytes."""
    return tuple(f"Bearer {s}".encode() for s in secrets)


def authorized(given: bytes, accepted: Iterable[bytes]) -> bool:
    """``given`` (an Authorization header's bytes) is one of ``accepted``."""
    return any(hmac.compare_digest(given, a) for a in accepted)


def accepted_key(headers: Iterable[tuple[bytes, bytes]], accepted: Iterable[bytes]) -> bytes | None:
    """The accepted key (as ``Bearer <key>``) the request carries in its
    ``Authorization``, or in Anthropic's ``x-api-key`` (what the Anthropic SDKs send);
    None if it carries none."""
    given: bytes | None = None
    api_key: bytes | None = None
    for name, value in headers:
        lower = name.lower()
        if lower == b"authorization" and given is None:
            given = value
        elif lower == b"x-api-key" and api_key is None:
            api_key = b"Bearer " + value
    keys = tuple(accepted)
    if given is not None and authorized(given, keys):
        return given
    if api_key is not None and authorized(api_key, keys):
        return api_key
    return None


def tenant(key: bytes | None) -> str | None:
    """Whose stored responses a request may reach: a digest of the accepted key it
    carries; None where the router has no ``api_keys`` (every client one tenant)."""
    return None if key is None else hashlib.blake2b(key, digest_size=16).hexdigest()
