"""The router's one exception tree, and its OpenAI-shaped error bodies.

    RouterError                      500 server_error
    ├── BadRequest                   400 invalid_request_error
    │   ├── PayloadTooLarge          413 invalid_request_error
    │   ├── RequestTimeout           408 invalid_request_error (the body came too slowly)
    │   ├── MethodNotAllowed         405 invalid_request_error (carries Allow)
    │   ├── UnsupportedEncoding      415 invalid_request_error (a Content-Encoding not decoded)
    │   └── ExpectationFailed        417 invalid_request_error (an Expect other than 100-continue)
    ├── Unauthenticated              401 authentication_error (a client's API key, an
    │                                    operator's metrics or admin token)
    ├── NotFound                     404 invalid_request_error (a path, an admin API name)
    │   ├── ModelNotFound            404 (code model_not_found)
    │   └── ResponseNotFound         404 (a stored response nobody holds; vLLM's words)
    ├── Conflict                     409 invalid_request_error
    ├── RetryLater                   (carries Retry-After and retry-after-ms)
    │   └── TooManyRequests          429 rate_limit_error
    │       └── Shed                 429 rate_limit_error (the router's queue let it go:
    │           │                        full, its deadline, displaced by a higher class)
    │           └── ShedOverloaded   529 overloaded_error (the same, Anthropic's API)
    ├── NoEligibleWorker             503 server_error
    ├── SharedStateUnavailable       503 server_error (a fleet-wide change could not be made)
    └── UpstreamError                502 server_error
        └── UpstreamTimeout          504 server_error

Third-party errors are translated where they happen (``raise ... from exc``); the
router's server (``router.edge.connection``) turns a ``RouterError`` into its answer, in
one place: ``status``, ``answer_body()``, ``headers()``, and a closed connection where
``closes_connection`` says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

from router.wire.headers import RETRY_AFTER_HEADER, RETRY_AFTER_MS_HEADER


class RouterError(Exception):
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None
    # The rest of the client's request may still be on its way: its connection cannot
    # carry another.
    closes_connection: ClassVar[bool] = False

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        # The API the error answers a request of, when not OpenAI's (router.apis.table).
        self.shape: Callable[[RouterError], dict[str, Any]] | None = None

    def answer_body(self) -> dict[str, Any]:
        """The body the client reads: ``body()``, in its API's shape."""
        return self.body() if self.shape is None else self.shape(self)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code or self.status,
            }
        }

    def headers(self) -> dict[str, str]:
        """Headers the answer carries besides its Content-Type."""
        return {}


class BadRequest(RouterError):
    status = 400
    error_type = "invalid_request_error"


class PayloadTooLarge(BadRequest):
    status = 413


class RequestTimeout(BadRequest):
    status = 408
    closes_connection = True


class MethodNotAllowed(BadRequest):
    status = 405

    def __init__(self, method: str, allowed: list[str]) -> None:
        if "GET" in allowed and "HEAD" not in allowed:
            allowed = [*allowed, "HEAD"]
        super().__init__(f"{method} is not allowed here; allowed: {', '.join(allowed)}")
        self.allowed = allowed

    def headers(self) -> dict[str, str]:
        return {"Allow": ",".join(self.allowed)}


class UnsupportedEncoding(BadRequest):
    status = 415
    closes_connection = True  # its body is refused unread


class ExpectationFailed(BadRequest):
    status = 417


class Unauthenticated(RouterError):
    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class NotFound(RouterError):
    status = 404
    error_type = "invalid_request_error"


class ModelNotFound(NotFound):
    code = "model_not_found"


class ResponseNotFound(NotFound):
    """vLLM's answer for a response id it does not hold (``_make_not_found_error``)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id '{response_id}' not found.", param="response_id")


class Conflict(RouterError):
    status = 409
    error_type = "invalid_request_error"


class RetryLater(RouterError):
    """A refusal the client may retry: ``Retry-After`` says when."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return retry_after_headers(self.retry_after_s)


def retry_after_headers(seconds: float) -> dict[str, str]:
    """``retry-after-ms`` (at least 1: the SDKs take 0 as no answer), for the SDKs that
    wait no longer than asked, and ``Retry-After`` in whole seconds, at least 1 (RFC 9110
    allows no fraction)."""
    ms = max(1, math.ceil(seconds * 1000))
    return {
        RETRY_AFTER_HEADER: str(max(1, math.ceil(ms / 1000))),
        RETRY_AFTER_MS_HEADER: str(ms),
    }


class TooManyRequests(RetryLater):
    status = 429
    error_type = "rate_limit_error"


class Shed(TooManyRequests):
    """The router's queue let a request go before any engine saw it; ``reason`` says
    why (``router.observability.queue_metrics.ShedReason``)."""

    def __init__(self, message: str, retry_after_s: float, reason: str) -> None:
        super().__init__(message, retry_after_s)
        self.reason = reason


class ShedOverloaded(Shed):
    """Anthropic's API says it is overloaded with its own status."""

    status = 529
    error_type = "overloaded_error"


class NoEligibleWorker(RouterError):
    status = 503


class SharedStateUnavailable(RouterError):
    status = 503


class UpstreamError(RouterError):
    status = 502


class UpstreamTimeout(UpstreamError):
    status = 504


class ConfigError(ValueError):
    """Configuration values that cannot be used: one problem or several (a file is
    checked whole, so ``check-config`` names every one), each naming its field."""

    def __init__(self, *problems: str) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class StoreUnavailable(ConfigError):
    """``--processes`` without ``state.url`` and no store binary (Valkey, Redis) that the
    processes could share state through."""


def failure_text(exc: BaseException) -> str:
    """One readable line for a failure worth a log line, not its repr:
    ``Cannot connect to host 10.0.0.7:8000 ssl:default [Connect call failed ...]``
    rather than ``ClientConnectorError(ConnectionKey(host=..., ...), ...)``."""
    if isinstance(exc, TimeoutError) and not str(exc):
        return "no answer in time"
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
