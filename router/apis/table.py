"""What differs between the client APIs the router keys and routes, in one table: the
engine's path, how its reply is read, what the next turn carries before the reply, and
the shape of its errors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from router.apis.anthropic_reply import MessagesCapture
from router.apis.anthropic_reply import error_body as anthropic_error_body
from router.apis.capture import ChatCapture, CompletionCapture, ReplyCapture
from router.apis.responses_reply import ResponsesCapture
from router.errors import RouterError, UpstreamError
from router.index.prefix import CHAT_REPLY_HEADER, COMPLETION_REPLY_HEADER
from router.wire.kinds import Kind

ErrorBody = Callable[[RouterError], dict[str, Any]]
# What the client reads when its worker fails mid-stream (the details go to the log; a
# worker's address is not the client's business).
MID_STREAM_ERROR = UpstreamError("the worker serving this request failed mid-stream")


def openai_error_body(error: RouterError) -> dict[str, Any]:
    return error.body()


@dataclass(frozen=True, slots=True)
class Api:
    kind: Kind
    path: bytes  # the engine's, and the router's
    capture: type[ReplyCapture]
    reply_header: bytes  # what the next turn carries before the reply
    error_body: ErrorBody
    mid_stream_error: bytes  # the SSE event that ends a stream whose worker failed


def _api(
    kind: Kind,
    path: bytes,
    capture: type[ReplyCapture],
    reply_header: bytes = CHAT_REPLY_HEADER,
    error_body: ErrorBody = openai_error_body,
    event: bytes = b"",
) -> Api:
    data = orjson.dumps(error_body(MID_STREAM_ERROR))
    return Api(kind, path, capture, reply_header, error_body, event + b"data: " + data + b"\n\n")


APIS: dict[Kind, Api] = {
    api.kind: api
    for api in (
        _api("chat", b"/v1/chat/completions", ChatCapture),
        _api("completion", b"/v1/completions", CompletionCapture, COMPLETION_REPLY_HEADER),
        _api("responses", b"/v1/responses", ResponsesCapture, event=b"event: error\n"),
        _api(
            "messages",
            b"/v1/messages",
            MessagesCapture,
            error_body=anthropic_error_body,
            event=b"event: error\n",
        ),
    )
}
KIND_OF_PATH: dict[bytes, Kind] = {api.path: api.kind for api in APIS.values()}


def error_body_for(path: str) -> ErrorBody:
    """The error shape of a path's API (``/v1/messages`` and below: Anthropic's), for
    errors raised before a route's handler knows its API (a missing API key)."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return anthropic_error_body
    return openai_error_body
