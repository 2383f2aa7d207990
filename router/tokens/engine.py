"""Prefix keys from a worker's own tokenizer (``prefix.tokenizer: engine``).

For fleets whose tokenizer files the router does not have: each request's ids come from
vLLM's ``POST /tokenize`` on a healthy worker serving its model (the least loaded), with
the request's own rendering options, so they are the ids that worker's engine caches and
announces. The cost is a round trip per request and the whole prompt encoded by the
engine's API server every turn (nothing incremental: a 100K-token prompt is ~170 ms of
its CPU); a local ``prefix.tokenizer`` directory avoids both. A worker that does not
answer within ``prefix.engine_timeout_s``, answers an error or something else than ids,
costs only the request's key: it is keyed by its text.

A session's previous-turn history is not located in token terms here (``history_blocks``
is 0): the read-your-writes lookup of replicas sharing state does not run for these keys.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from router.apis.request import ClientRequest, RequestBody, keyed, keyed_by_text
from router.fleet.workers import Fleet, Worker
from router.index.stored_chain import StoredChain
from router.tokens.keys import MAX_PENDING, TokenMetrics
from router.wire.blocks import token_bytes

log = logging.getLogger(__name__)

# Fields of a chat request that change what vLLM's /tokenize renders (its
# TokenizeChatRequest); the rest of the request is not the tokenizer's business.
CHAT_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
)
COMPLETION_FIELDS = ("prompt", "add_special_tokens")
# Answers larger than this are not a prompt's ids (a 1M-token prompt is ~8 MB of JSON).
MAX_ANSWER_BYTES = 64 * 1024 * 1024


class EngineTokens:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        fleet: Fleet,
        timeout_s: float,
        metrics: TokenMetrics,
        auth_headers: Mapping[str, str] | None = None,
        stale_after_s: float | None = None,
    ) -> None:
        self._session = session
        self._fleet = fleet
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = dict(auth_headers or {})
        self._stale_after_s = stale_after_s
        self.metrics = metrics
        self._pending = 0

    async def key(self, body: RequestBody, block_bytes: int) -> ClientRequest:
        prompt = body.prompt
        if prompt is not None and not isinstance(prompt, str):
            self.metrics.requests.labels("tokens").inc()  # the engine's ids already
            return keyed(body, token_bytes(prompt), 1, block_bytes, False)
        worker = self._tokenizer_for(body.model)
        if worker is None:
            return self._by_text(body, block_bytes, "text")
        if self._pending >= MAX_PENDING:
            return self._by_text(body, block_bytes, "busy")
        fields = CHAT_FIELDS if body.messages is not None else COMPLETION_FIELDS
        given = body.rendered_fields
        request = {"model": body.model, **{k: given[k] for k in fields if k in given}}
        self._pending += 1
        started = time.perf_counter()
        try:
            ids = await self._tokenize(worker, request)
        finally:
            self._pending -= 1
        if ids is None:
            return self._by_text(body, block_bytes, "text")
        self.metrics.seconds.observe(time.perf_counter() - started)
        self.metrics.encoded.inc(len(ids))
        self.metrics.requests.labels("tokens").inc()
        return keyed(body, token_bytes(ids), 0, block_bytes, False)

    def _tokenizer_for(self, model: str) -> Worker | None:
        candidates = self._fleet.eligible(model, (), self._stale_after_s)
        return min(candidates, key=lambda w: (w.load, w.name), default=None)

    async def _tokenize(self, worker: Worker, request: dict[str, Any]) -> list[int] | None:
        """The worker's ids for ``request``, or None (logged) when it gives none."""
        try:
            async with self._session.post(
                worker.url + "/tokenize",
                data=orjson.dumps(request),
                headers={"Content-Type": "application/json", **self._headers},
                timeout=self._timeout,
            ) as response:
                if response.status != 200:
                    log.debug("worker %s /tokenize answered %d", worker.name, response.status)
                    return None
                raw = await response.content.read(MAX_ANSWER_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.debug("worker %s /tokenize failed: %r", worker.name, exc)
            return None
        return token_ids_of(raw)

    def _by_text(self, body: RequestBody, block_bytes: int, result: str) -> ClientRequest:
        self.metrics.requests.labels(result).inc()
        return keyed_by_text(body, block_bytes)

    async def continued(
        self, body: RequestBody, chain: StoredChain, block_bytes: int
    ) -> ClientRequest | None:
        """Never: a conversation's chain holds its reply, which prompts keyed by a
        worker's /tokenize leave out (``reply_tokens``)."""
        return None

    async def reply_tokens(self, text: str) -> bytes | None:
        """Prompts keyed by a worker's /tokenize leave replies out of the chain."""
        return None

    def close(self) -> None:
        """Nothing of its own to stop: the session is the app's."""


def token_ids_of(raw: bytes) -> list[int] | None:
    if len(raw) > MAX_ANSWER_BYTES:
        return None
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    ids = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(ids, list) or not ids or set(map(type, ids)) != {int}:
        return None
    if min(ids) < 0 or max(ids) >= 2**32:
        return None
    return ids
