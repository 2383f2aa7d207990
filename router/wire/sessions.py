"""Where a client names its session, and the grammar of ``session_keys`` entries.

A session key is read from the first of an ordered list of sources that the request
carries: ``header:NAME`` (a request header, any case), ``body:FIELD`` (a top-level string
field of the body) or ``api`` (the API's own session field: Responses'
``prompt_cache_key``, Codex's conversation id; Messages' ``metadata.user_id``, Claude
Code's session id).

The default order puts the key a client sends on purpose first, then the keys coding
agents send on their own, then the body's fields. ``X-Correlation-ID`` is not among them:
aiperf names a whole conversation with it (and with ``X-Session-Affinity``, which is),
but gateways often stamp one on every request, and a key per request would make every
request a session of its own (``serve --session-header x-correlation-id`` reads it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from router.wire.headers import SESSION_HEADER

SourceKind = Literal["header", "body", "api"]

# Sent by the agents themselves, on every request of a session.
CLAUDE_CODE_SESSION_HEADER = "x-claude-code-session-id"
SESSION_AFFINITY_HEADER = "x-session-affinity"  # OpenCode; aiperf's multi-turn sessions
CODEX_SESSION_HEADERS = ("session_id", "session-id")
# aiperf's id of a conversation; elsewhere often one request's (not read by default).
CORRELATION_HEADER = "x-correlation-id"
# A subagent's parent session (Dynamo's; aiperf sends it for AgentX subagents).
PARENT_SESSION_HEADER = "x-dynamo-parent-session-id"

DEFAULT_SESSION_KEYS = (
    f"header:{SESSION_HEADER.lower()}",
    f"header:{CLAUDE_CODE_SESSION_HEADER}",
    f"header:{SESSION_AFFINITY_HEADER}",
    *(f"header:{name}" for name in CODEX_SESSION_HEADERS),
    "body:session_id",
    "body:user",
    "api",
)

# RFC 9110's token: the characters a header name may hold.
_HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


@dataclass(frozen=True, slots=True)
class SessionSource:
    kind: SourceKind
    name: str  # the header's name in lower case, the body's field; "" for "api"

    @property
    def label(self) -> str:
        """How the source is written in the config, the request log and metric labels."""
        return "api" if self.kind == "api" else f"{self.kind}:{self.name}"


def parse_source(text: str) -> SessionSource:
    """``header:NAME``, ``body:FIELD`` or ``api``; ``ValueError`` saying why not."""
    if text == "api":
        return SessionSource("api", "")
    kind, _, name = text.partition(":")
    if kind == "header":
        if not _HEADER_NAME.match(name):
            raise ValueError(f"{text!r}: a header name is a non-empty HTTP token")
        return SessionSource("header", name.lower())
    if kind == "body":
        if not name:
            raise ValueError(f"{text!r}: name the body field after 'body:'")
        return SessionSource("body", name)
    raise ValueError(f"{text!r}: expected 'header:NAME', 'body:FIELD' or 'api'")
