"""The router's one exception tree, and its OpenAI-shaped error bodies.

    RouterError                      500 server_error
    ├── BadRequest                   400 invalid_request_error
    │   ├── PayloadTooLarge          413 invalid_request_error
    │   ├── RequestTimeout           408 invalid_request_error (the body came too slowly)
    │   ├── UnsupportedEncoding      415 invalid_request_error (a Content-Encoding not decoded)
    │   └── ExpectationFailed        417 invalid_request_error (an Expect other than 100-continue)
    ├── ModelNotFound                404 invalid_request_error (code model_not_found)
    ├── NoEligibleWorker             503 server_error
    ├── SharedStateUnavailable       503 server_error (a fleet-wide change could not be made)
    └── UpstreamError                502 server_error
        └── UpstreamTimeout          504 server_error

Third-party errors are translated where they happen (``raise ... from exc``); each
server (``router.front``, the aiohttp app's error middleware) turns a ``RouterError`` into
its answer: ``status``, ``body()``, ``headers()``, and a closed connection where
``closes_connection`` says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar


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
        # The API the error answers a request of, when not OpenAI's (router.apis.kinds).
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


class UnsupportedEncoding(BadRequest):
    status = 415
    closes_connection = True  # its body is refused unread


class ExpectationFailed(BadRequest):
    status = 417


class ModelNotFound(RouterError):
    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class NoEligibleWorker(RouterError):
    status = 503


class SharedStateUnavailable(RouterError):
    status = 503


class UpstreamError(RouterError):
    status = 502


class UpstreamTimeout(UpstreamError):
    status = 504


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the field."""
