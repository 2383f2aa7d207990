"""How one attempt through the router ends: recorded and finished exactly once.

A successful reply is recorded (the shared state in Redis, then the local index and
learning, and a stored response's owner) before its end reaches the client, so the
session's next turn, sent the moment the client has it, finds it on any replica. The
reply's blocks come from its ``ReplyChain``: by its text, by its tokens, or none on an
exact worker.
"""

from __future__ import annotations

from policies.base import Outcome
from router.apis.capture import ReplyCapture, ReplyChain
from router.index.prefix import ChainExtender
from router.routing.dispatch import Dispatch, EngineUsage
from router.routing.lifecycle import RequestLifecycle
from router.routing.response_owners import Owner
from router.state import RouterState
from router.tokens.reply import TokenReplyChain


class Settlement:
    """How one attempt ends, settled exactly once, by whichever comes first: ``complete``
    when the engine's whole reply is in hand (a stream's terminal event, a whole body),
    before the client can have it; ``finish`` when the client saw bytes and the attempt
    ended some other way (or after ``complete``: then it changes nothing); ``fail`` when
    the client saw none."""

    __slots__ = ("_capture", "_dispatch", "_lifecycle", "_state", "_tenant", "outcome")

    def __init__(
        self,
        state: RouterState,
        lifecycle: RequestLifecycle,
        dispatch: Dispatch,
        capture: ReplyCapture,
        tenant: str | None,
    ) -> None:
        self._state = state
        self._tenant = tenant  # whose a stored response is
        self._lifecycle = lifecycle
        self._dispatch = dispatch
        self._capture = capture
        self.outcome: Outcome | None = None  # None: not settled yet

    async def complete(self, outcome: Outcome) -> None:
        """The engine has sent everything. What a successful reply leaves on its worker
        is recorded (Redis, then the index and learning) before its end reaches the
        client, so a next turn sent the moment the client has it finds it, on this
        replica or another; a client that then leaves has still been served."""
        if self.outcome is not None:
            return
        if outcome == "success":
            await self._capture.settle()
            await record_reply(self._state, self._dispatch, self._capture, self._tenant)
        self.finish(outcome)

    def finish(self, outcome: Outcome) -> None:
        if self.outcome is not None:
            return
        self.outcome = outcome
        capture = self._capture
        if capture.usage_rejected:
            metrics = self._state.router.metrics
            metrics.counter(metrics.engine_usage_rejected, self._dispatch.worker.name).inc()
        prompt, cached = capture.prompt_tokens, capture.cached_tokens
        usage = (
            EngineUsage(prompt, cached, capture.completion_tokens)
            if prompt is not None and cached is not None
            else None
        )
        reply = capture.reply_hashes() if outcome == "success" else []
        self._dispatch.turn_end = capture.turn_end
        self._lifecycle.finished(self._dispatch, outcome, reply, usage, prompt)

    def fail(self, outcome: Outcome) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self._lifecycle.failed(self._dispatch, outcome)


def reply_chain(state: RouterState, dispatch: Dispatch, header: bytes) -> ReplyChain | None:
    """How the reply extends the request's chain: by its text where the prompt was
    keyed by text, by its tokens where by the model's tokens (``router.tokens.reply``),
    not at all on an exact worker: its engine announces what it generated."""
    prefix, request = state.config.prefix, dispatch.request
    if not prefix.record_replies:
        return None
    if request.record_reply:
        return ChainExtender(request.key, prefix.key_block_bytes, header)
    tokens = state.tokens
    exact = state.router.index.prefix_mode(dispatch.worker.name) == "exact"
    if request.reply_tokens and tokens is not None and not exact:
        return TokenReplyChain(request.key, prefix.key_block_bytes, tokens.reply_tokens)
    return None


async def record_reply(
    state: RouterState, dispatch: Dispatch, capture: ReplyCapture, tenant: str | None
) -> None:
    """What the reply leaves on its worker, recorded before its end reaches the client:
    the session's next turn, or a request continuing the response, finds it whichever
    replica it goes to. The blocks reach Redis here (the local index hears of them when
    the request is settled); a stored response's owner, here and in Redis."""
    shared = state.shared_path
    if shared is not None:
        await shared.record(
            dispatch.worker,
            dispatch.route.block_hashes,
            capture.reply_hashes(),
            dispatch.request.session_key,
        )
    if capture.response_id is not None:
        owner = Owner.of(dispatch.worker, tenant)
        state.response_owners.remember(capture.response_id, owner)
        if shared is not None:
            await shared.remember_response(capture.response_id, owner)
