"""A JSON answer on the aiohttp app (the router's own server writes its bytes itself,
``router.wire.http1``)."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")
