"""vLLM's error shape and the typed reading of a request body's fields, shared by the
simulated engine's parsers (``openai_api.py``, ``prompts.py``, ``tokenize.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.apis.invalid import InvalidBody


class ApiError(Exception):
    """An error answered with vLLM's error body and an HTTP status."""

    def __init__(
        self, status: int, message: str, err_type: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type or _ERROR_TYPES.get(status, "InternalServerError")
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


def invalid(exc: InvalidBody) -> ApiError:
    """A body field the request model refused, answered as vLLM answers it: by FastAPI's
    validation (a 400 of type "Bad Request", ``param`` "body.<field>"), else by the
    server's own check after it."""
    if not exc.validation:
        return ApiError(400, exc.message, param=exc.field)
    detail = {"type": exc.error_type, "loc": ("body", exc.field), "msg": exc.message}
    return ApiError(400, f"1 validation error:\n  {detail!r}", "Bad Request", f"body.{exc.field}")


def missing(body: Mapping[str, Any], name: str) -> ApiError:
    """A required body field left out, in the words of vLLM 0.32's validation handler
    (pydantic's error, ``loc`` joined, the body summarized as ``input``)."""
    detail = {
        "type": "missing",
        "loc": f"body.{name}",
        "msg": "Field required",
        "input": f"<dict of {len(body)} items>",
    }
    return ApiError(400, f"1 validation error:\n  {detail!r}", "Bad Request", f"body.{name}")


_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def field(
    body: Mapping[str, Any], name: str, types: type | tuple[type, ...], default: Any = None
) -> Any:
    """``body[name]`` when it is one of ``types`` (absent or null: ``default``); else 400."""
    value = body.get(name)
    if value is None:
        return default
    allowed = types if isinstance(types, tuple) else (types,)
    # bool is an int subclass: never accept it where a number is expected.
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise ApiError(400, f"'{name}' has the wrong type", param=name)
    return value


def request_body(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def requested_model(body: Mapping[str, Any], served_model: str) -> str:
    """The model a request names (the served one when it names none); any other is a
    404, as vLLM's model check."""
    model: str = field(body, "model", str, served_model)
    if model != served_model:
        message = f"The model `{model}` does not exist. Valid aliases: {served_model}."
        raise ApiError(404, message, param="model")
    return model
