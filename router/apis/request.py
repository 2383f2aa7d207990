"""Client requests: validate the body and compute its prefix key, once per request.

This runs on the event loop, so no walk of the body is unbounded: messages and content
parts are walked in Python up to ``RequestLimits``; token ids (millions fit in a body)
only at C speed. Malformed input of any shape ends in ``BadRequest``.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from router.apis.sessions import NO_SESSION, SessionKey, SessionSources
from router.apis.views import ChatView, ResponsesLink, messages_chat, responses_chat
from router.config import RequestLimits
from router.errors import BadRequest
from router.index.prefix import (
    PrefixKey,
    chain_seed,
    extended_key,
    prefix_key,
    render_chat_history,
    render_prompt,
)
from router.index.stored_chain import KeyedBy, StoredChain
from router.wire.kinds import Kind

CONVERTED: dict[Kind, Callable[[Mapping[str, Any]], ChatView]] = {
    "messages": messages_chat,
    "responses": responses_chat,
}
DEFAULT_LIMITS = RequestLimits()
DEFAULT_SOURCES = SessionSources()
NO_HEADERS: Mapping[bytes, bytes] = {}


class _NamedSession:
    """What a request's session says, read from its ``session``."""

    __slots__ = ()
    session: SessionKey | None

    @property
    def session_key(self) -> str | None:
        """A digest of the client's session key (``router.apis.sessions``), never the key."""
        return None if self.session is None else self.session.digest

    @property
    def session_source(self) -> str:
        """Where the session key was read, its label; ``none`` without one."""
        return NO_SESSION if self.session is None else self.session.source

    @property
    def ends_session(self) -> bool:
        """The client marked this its session's last request (SESSION_END_HEADER)."""
        return self.session is not None and self.session.ends

    @property
    def parent_session(self) -> str | None:
        """The digest of the session that spawned this one (a subagent's parent)."""
        return None if self.session is None else self.session.parent


@dataclass(frozen=True, slots=True)
class ClientRequest(_NamedSession):
    kind: Kind
    model: str
    body: bytes  # forwarded unchanged
    stream: bool
    session: SessionKey | None
    key: PrefixKey
    record_reply: bool  # whether the reply's text extends the chain (text prompts)
    # Leading blocks an earlier turn of this session left cached somewhere, if there was
    # one (its prompt; router.index.prefix.render_chat_history). A completion's prompt has no
    # turns to tell apart: 1, any cached prefix.
    history_blocks: int = 0
    # A Responses request continuing a stored response (``previous_response_id``): it
    # must reach the worker that stored it, and its prompt is that worker's secret.
    continues: str | None = None
    # A chat prompt keyed by the model's tokens: the reply extends the chain by its
    # text's tokens (router.tokens.reply).
    reply_tokens: bool = False
    # A conversation with no reply in it yet: whatever of its prompt a worker holds, other
    # sessions put there (a shared system prompt, an agent's tool definitions).
    first_turn: bool = False
    # A Responses request's place in its conversation: whether, and how, the chain of
    # its prompt and reply is kept for a request continuing it.
    link: ResponsesLink | None = None
    # The key holds only the first blocks of a conversation cut at its bound
    # (router.index.stored_chain), keyed by text or by tokens: nothing extends it.
    cut_from: KeyedBy | None = None

    @property
    def cut(self) -> bool:
        return self.cut_from is not None


def _check_parts(parts: list[Any], i: int) -> None:
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise BadRequest(f"messages[{i}].content[{j}] must be an object", param="messages")
        if part.get("type") == "text" and not isinstance(part.get("text", ""), str):
            raise BadRequest(f"messages[{i}].content[{j}].text must be a string", param="messages")


def _check_messages(messages: Any, limits: RequestLimits) -> Sequence[Mapping[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    if len(messages) > limits.max_messages:
        raise BadRequest(
            f"'messages' has {len(messages)} messages; at most {limits.max_messages} are accepted",
            param="messages",
        )
    parts = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}] must be an object", param="messages")
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}].role must be a string", param="messages")
        content = message.get("content")
        if isinstance(content, list):
            parts += len(content)
            if parts > limits.max_content_parts:
                raise BadRequest(
                    f"'messages' has more than {limits.max_content_parts} content parts",
                    param="messages",
                )
            _check_parts(content, i)
        elif content is not None and not isinstance(content, str):
            raise BadRequest(
                f"messages[{i}].content must be a string or an array", param="messages"
            )
    return messages


def _render_chat(messages: Sequence[Mapping[str, Any]]) -> tuple[bytes, int]:
    try:
        return render_chat_history(messages)
    except orjson.JSONEncodeError as exc:
        # Non-text parts and tool_calls are rendered as JSON, which orjson writes only
        # up to 254 levels deep; parsed JSON can hold nothing else it refuses.
        raise BadRequest(f"'messages' is nested too deeply: {exc}", param="messages") from None


def _token_ids(value: list[int]) -> array[int]:
    try:
        return array("I", value)  # C unsigned int: 4 bytes wherever CPython runs
    except OverflowError:
        raise BadRequest("token ids must be between 0 and 2**32 - 1", param="prompt") from None


def _prompt(value: Any) -> str | Sequence[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        kinds = set(map(type, value))  # one pass at C speed; bools are not token ids
        if kinds == {int}:
            return _token_ids(value)
        if kinds == {str}:
            first: str = value[0]
            return first  # a batch: route by its first prompt
    raise BadRequest(
        "'prompt' must be a string, an array of strings or an array of token ids", param="prompt"
    )


@dataclass(frozen=True, slots=True)
class RequestBody(_NamedSession):
    """A client request read and checked, before its prefix key is computed."""

    kind: Kind
    model: str
    raw: bytes
    fields: Mapping[str, Any]  # the parsed body
    stream: bool
    session: SessionKey | None
    seed: int  # the chain's seed: the model and the cache salt
    messages: Sequence[Mapping[str, Any]] | None  # chat, and the APIs converted to it
    prompt: str | Sequence[int] | None  # completions
    # For the converted APIs, the chat request's fields (``fields`` is what the client
    # sent); for chat and completions ``fields`` itself.
    chat_fields: Mapping[str, Any] | None = None
    continues: str | None = None  # Responses' previous_response_id
    link: ResponsesLink | None = None  # Responses: its place in its conversation

    @property
    def rendered_fields(self) -> Mapping[str, Any]:
        """The fields that decide what the engine renders: a chat or completion body."""
        return self.fields if self.chat_fields is None else self.chat_fields


def read_request(
    kind: Kind,
    raw: bytes,
    session_headers: Mapping[bytes, bytes] = NO_HEADERS,
    sources: SessionSources = DEFAULT_SOURCES,
    limits: RequestLimits = DEFAULT_LIMITS,
    tenant: str | None = None,
) -> RequestBody:
    """``session_headers``: the request's headers named in ``sources.header_names``
    (lower-case names, the first of each); ``tenant``: whose session keys they are."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    convert = CONVERTED.get(kind)
    if convert is not None:
        view = convert(body)
        session = sources.find(
            session_headers, body, view.session, limits.max_session_key_bytes, tenant
        )
        return _converted(kind, raw, body, view, session, limits)
    model = _model(body)
    stream = _stream(body)
    session = sources.find(session_headers, body, None, limits.max_session_key_bytes, tenant)
    chat = kind == "chat"
    return RequestBody(
        kind=kind,
        model=model,
        raw=raw,
        fields=body,
        stream=stream,
        session=session,
        seed=_seed(body, model),
        messages=_check_messages(body.get("messages"), limits) if chat else None,
        prompt=None if chat else _prompt(body.get("prompt")),
    )


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    return model


def _stream(body: Mapping[str, Any]) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise BadRequest("'stream' must be a boolean", param="stream")
    return bool(stream)


def _seed(body: Mapping[str, Any], model: str) -> int:
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest("'cache_salt' must be a string", param="cache_salt")
    return chain_seed(model, salt)


def _converted(
    kind: Kind,
    raw: bytes,
    body: Mapping[str, Any],
    chat: ChatView,
    session: SessionKey | None,
    limits: RequestLimits,
) -> RequestBody:
    """A Responses or Messages request, keyed as the chat request ``chat``."""
    messages = chat.fields["messages"]
    model = _model(chat.fields)
    return RequestBody(
        kind=kind,
        model=model,
        raw=raw,
        fields=body,
        stream=_stream(body),
        session=session,
        seed=_seed(chat.fields, model),
        messages=_check_messages(messages, limits) if messages else (),
        prompt=None,
        chat_fields=chat.fields,
        continues=chat.continues,
        link=chat.link,
    )


def keyed_by_text(body: RequestBody, block_bytes: int) -> ClientRequest:
    """The request keyed by its canonical bytes (router.index.prefix): the default mode."""
    if body.continues is not None:
        return keyed_blind(body)
    if body.messages is not None:
        canonical, history_bytes = _render_chat(body.messages)
        return keyed(body, canonical, history_bytes // block_bytes, block_bytes, True)
    assert body.prompt is not None
    return keyed(body, render_prompt(body.prompt), 1, block_bytes, isinstance(body.prompt, str))


def keyed_blind(body: RequestBody) -> ClientRequest:
    """A request whose prompt the router cannot know (it continues a response stored on
    a worker): no blocks, so it claims nothing in the index; its size is what it adds."""
    assert body.messages is not None
    canonical, _ = _render_chat(body.messages)
    key = PrefixKey((), b"", body.seed, len(canonical))
    return _client_request(body, key, 0, record_reply=False)


def new_input(body: RequestBody) -> Sequence[Mapping[str, Any]]:
    """A Responses request's input as chat messages (after its instructions)."""
    assert body.messages is not None and body.link is not None
    return body.messages[body.link.input_from :]


def keyed_continuing(body: RequestBody, chain: StoredChain, block_bytes: int) -> ClientRequest:
    """A request continuing a stored response whose conversation was keyed by text,
    keyed as the whole conversation would be. The caller has checked that ``chain``
    fits the request (``StoredChain.fits``)."""
    suffix, _ = _render_chat(new_input(body))
    return keyed_after(body, chain, suffix, block_bytes)


def keyed_after(
    body: RequestBody, chain: StoredChain, suffix: bytes, block_bytes: int
) -> ClientRequest:
    """``body`` keyed as ``chain``'s conversation followed by ``suffix``, canonical bytes
    of the chain's kind (text, or token ids); its reply extends it alike. A cut chain
    is the key as it is: the request matches no more than its blocks, and its size is
    the conversation's and the suffix's."""
    if not chain.whole:
        conversation = chain.key()
        cut = PrefixKey(conversation.hashes, b"", body.seed, chain.total_bytes + len(suffix))
        return _client_request(body, cut, chain.blocks, False, cut_from=chain.keyed_by)
    key = extended_key(chain.key(), suffix, block_bytes)
    by_tokens = chain.keyed_by == "tokens"
    return _client_request(body, key, chain.blocks, not by_tokens, reply_tokens=by_tokens)


def keyed(
    body: RequestBody,
    canonical: bytes,
    history_blocks: int,
    block_bytes: int,
    record_reply: bool,
    reply_tokens: bool = False,
) -> ClientRequest:
    return _client_request(
        body,
        prefix_key(canonical, block_bytes, body.seed),
        history_blocks,
        record_reply,
        reply_tokens,
    )


def _client_request(
    body: RequestBody,
    key: PrefixKey,
    history_blocks: int,
    record_reply: bool,
    reply_tokens: bool = False,
    cut_from: KeyedBy | None = None,
) -> ClientRequest:
    return ClientRequest(
        kind=body.kind,
        model=body.model,
        body=body.raw,
        stream=body.stream,
        session=body.session,
        key=key,
        record_reply=record_reply,
        history_blocks=min(history_blocks, len(key.hashes)),
        continues=body.continues,
        reply_tokens=reply_tokens,
        first_turn=_first_turn(body),
        link=body.link,
        cut_from=cut_from,
    )


def _first_turn(body: RequestBody) -> bool:
    """A chat conversation (or a Messages or Responses one, converted) with no assistant
    message and no stored response it continues; a completion's prompt says nothing."""
    if body.messages is None or body.continues is not None:
        return False
    return all(message.get("role") != "assistant" for message in body.messages)


def parse_request(
    kind: Kind,
    raw: bytes,
    block_bytes: int,
    session_headers: Mapping[bytes, bytes] = NO_HEADERS,
    sources: SessionSources = DEFAULT_SOURCES,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> ClientRequest:
    """Read, check and key a request by its text (``read_request``, ``keyed_by_text``)."""
    body = read_request(kind, raw, session_headers, sources, limits)
    return keyed_by_text(body, block_bytes)
