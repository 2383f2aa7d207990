"""One JSON line per request on the ``kvrouter.requests`` logger (``log_requests: true``).

What was decided and what came of it: worker, policy reason, predicted / best / engine
cached tokens, TTFT, latency, outcome. Never the prompt, the reply or any header; the
session key appears only as a short hash, enough to follow a session across lines.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import orjson
import xxhash

from policies.base import Outcome

if TYPE_CHECKING:
    from router.routing.dispatch import Dispatch, EngineUsage

log = logging.getLogger("kvrouter.requests")


def session_tag(key: str | None) -> str | None:
    return None if key is None else xxhash.xxh64_hexdigest(key.encode())[:12]


def request_line(
    dispatch: Dispatch, outcome: Outcome, usage: EngineUsage | None, latency_s: float, attempt: int
) -> dict[str, Any]:
    route, decision = dispatch.route, dispatch.decision
    return {
        "ts": round(time.time(), 3),
        "request_id": route.request_id,
        "model": route.model,
        "session": session_tag(route.session_key),
        "session_source": dispatch.request.session_source,
        "parent": session_tag(dispatch.request.parent_session),
        "worker": dispatch.worker.name,
        "policy_reason": decision.reason,
        "attempt": attempt,
        "outcome": outcome,
        "prompt_tokens": usage.prompt_tokens if usage else route.prompt_tokens,
        "matched_blocks": decision.predicted_cached_tokens // max(1, route.block_tokens),
        "predicted_cached_tokens": decision.predicted_cached_tokens,
        # Of the prompt beyond the chosen worker's GPU match, what its CPU tier held.
        "offloaded_tokens": dispatch.offloaded,
        "best_cached_tokens": dispatch.best_match,
        "engine_cached_tokens": usage.cached_tokens if usage else None,
        "ttft_s": None if dispatch.ttft is None else round(dispatch.ttft, 4),
        "latency_s": round(latency_s, 4),
    }


def write(line: dict[str, Any]) -> None:
    log.info("%s", orjson.dumps(line).decode())
