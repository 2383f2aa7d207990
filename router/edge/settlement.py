"""How one attempt through the router ends: recorded and finished exactly once.

A successful reply is recorded (the shared state in Redis, then the local index and
learning, and a stored response's owner with its conversation's chain) before its end
reaches the client, so the session's next turn, sent the moment the client has it,
finds it on any replica. The reply's blocks come from its ``ReplyChain``: by its text,
by its tokens, or none on an exact worker (whose engine announces them), where a
Responses reply's chain is still followed for the conversation kept with its owner.
"""

from __future__ import annotations

from policies.base import Outcome
from router.apis.capture import ReplyCapture, ReplyChain
from router.apis.request import ClientRequest
from router.index.prefix import ChainExtender
from router.index.stored_chain import KeyedBy, StoredChain
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

    __slots__ = (
        "_capture",
        "_dispatch",
        "_lifecycle",
        "_records_reply",
        "_state",
        "_tenant",
        "outcome",
    )

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
        self._records_reply = records_reply(state, dispatch)
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
            reply = self._reply_hashes()
            await record_reply(self._state, self._dispatch, self._capture, reply, self._tenant)
        self.finish(outcome)

    def _reply_hashes(self) -> list[int]:
        """The reply's blocks as the index takes them."""
        return self._capture.reply_hashes() if self._records_reply else []

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
        reply = self._reply_hashes() if outcome == "success" else []
        self._dispatch.turn_end = capture.turn_end
        self._lifecycle.finished(self._dispatch, outcome, reply, usage, prompt)

    def fail(self, outcome: Outcome) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self._lifecycle.failed(self._dispatch, outcome)


def records_reply(state: RouterState, dispatch: Dispatch) -> bool:
    """Whether the reply's blocks go into the index (``prefix.record_replies``): by its
    text where the prompt was keyed by text, by its tokens where by the model's tokens,
    not on an exact worker, whose engine announces what it generated."""
    if not state.config.prefix.record_replies:
        return False
    exact = state.router.index.prefix_mode(dispatch.worker.name) == "exact"
    return dispatch.request.record_reply or not exact


def reply_chain(state: RouterState, dispatch: Dispatch, header: bytes) -> ReplyChain | None:
    """How the reply extends the request's chain, where the index takes its blocks
    (``records_reply``) or a request continuing the response will be keyed from it: by
    its text where the prompt was keyed by text, by its tokens where by the model's
    tokens (``router.tokens.reply``)."""
    request = dispatch.request
    kept = request.link is not None and request.link.extendable
    if not (kept or records_reply(state, dispatch)):
        return None
    block_bytes = state.config.prefix.key_block_bytes
    if request.record_reply:
        return ChainExtender(request.key, block_bytes, header)
    tokens = state.tokens
    if request.reply_tokens and tokens is not None:
        return TokenReplyChain(request.key, block_bytes, tokens.reply_tokens)
    return None


async def record_reply(
    state: RouterState,
    dispatch: Dispatch,
    capture: ReplyCapture,
    reply: list[int],
    tenant: str | None,
) -> None:
    """What the reply leaves on its worker, recorded before its end reaches the client:
    the session's next turn, or a request continuing the response, finds it whichever
    replica it goes to. The blocks (``reply``: the reply's, as the index takes them)
    reach Redis here (the local index hears of them when the request is settled); a
    stored response's owner and its conversation's chain, here and in Redis."""
    shared = state.shared_path
    if shared is not None:
        await shared.record(
            dispatch.worker, dispatch.route.block_hashes, reply, dispatch.request.session_key
        )
    if capture.response_id is not None:
        owner = Owner.of(dispatch.worker, tenant)
        chain = conversation_chain(dispatch.request, capture, state.config.prefix.key_block_bytes)
        state.response_owners.remember(capture.response_id, owner, chain)
        if shared is not None:
            await shared.remember_response(capture.response_id, owner, chain)


def conversation_chain(
    request: ClientRequest, capture: ReplyCapture, block_bytes: int
) -> StoredChain | None:
    """The chain a request continuing this response is keyed from: its prompt's and
    reply's (``ReplyCapture.continuation``), or, where the request's key was already
    cut at the bound, that key as it is; None where the conversation cannot be
    continued as an extension (``ResponsesLink.extendable``) or its chain is unknown."""
    link = request.link
    if link is None or not link.extendable:
        return None
    if request.cut_from is not None:
        cut_from = request.cut_from  # the kind of the cut chain its key is
        return StoredChain.of(request.key, cut_from, block_bytes, link.context, whole=False)
    keyed_by: KeyedBy = "tokens" if request.reply_tokens else "text"
    if capture.continuation is None:
        return None
    return StoredChain.of(capture.continuation, keyed_by, block_bytes, link.context)
