"""The header names kvrouter adds to answers or reads from requests (case-insensitive on
the wire; written here as they are sent)."""

from __future__ import annotations

# Which worker served the request (on with ``worker_header``): replays and tests read it.
WORKER_HEADER = "X-Kvrouter-Worker"
# The session key a client sends on purpose (the first of ``session_keys``' defaults).
SESSION_HEADER = "X-Session-Id"
# On a session's last request ("1" or "true"): nothing follows its reply, and the
# session is counted finished (kvrouter_session_turn_ends_total{waiting_on="finished"}).
SESSION_END_HEADER = "X-Session-End"
# A request's id: the client's, passed on to the engine, or the router's own.
REQUEST_ID_HEADER = "X-Request-Id"
# A request's class in the router's queue: "batch" lowers it below interactive requests
# (a client key listed in admission.batch_api_keys is batch whatever it asks).
PRIORITY_HEADER = "X-Kvrouter-Priority"
# When a refused request may be sent again: whole seconds (RFC 9110), and the same in
# milliseconds, which OpenAI's and Anthropic's SDKs read first.
RETRY_AFTER_HEADER = "Retry-After"
RETRY_AFTER_MS_HEADER = "retry-after-ms"
