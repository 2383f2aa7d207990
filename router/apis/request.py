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
import xxhash

from router.apis.views import (
    OWN_SESSION,
    ChatView,
    ResponsesLink,
    messages_chat,
    responses_chat,
)
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
from router.index.stored_chain import StoredChain
from router.wire.kinds import Kind

CONVERTED: dict[Kind, Callable[[Mapping[str, Any]], ChatView]] = {
    "messages": messages_chat,
    "responses": responses_chat,
}
DEFAULT_LIMITS = RequestLimits()


@dataclass(frozen=True, slots=True)
class ClientRequest:
    kind: Kind
    model: str
    body: bytes  # forwarded unchanged
    stream: bool
    # A digest of the client's session key (``session_key_of``), never the key itself.
    session_key: str | None
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
    # A Responses request's place in its conversation: whether, and how, the chain of
    # its prompt and reply is kept for a request continuing it.
    link: ResponsesLink | None = None
    # The key holds only the first blocks of a conversation cut at its bound
    # (router.index.stored_chain): nothing extends it.
    cut: bool = False


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


def header_bytes(value: str) -> bytes:
    """A header value as the client sent it. aiohttp decodes header bytes as UTF-8 with
    surrogate escapes, so bytes that are not UTF-8 (latin-1, binary) come back unchanged
    here, where a plain ``encode()`` raises."""
    try:
        return value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        # A surrogate no decoding of bytes makes (a caller other than aiohttp): some
        # bytes all the same, the same ones for the same string.
        return value.encode("utf-8", "surrogatepass")


def _session_digest(key: str | bytes, param: str | None, max_bytes: int) -> str:
    # A body field holds no surrogates: orjson refuses them.
    raw = key if isinstance(key, bytes) else header_bytes(key)
    if len(raw) > max_bytes:
        where = f"'{param}'" if param else "the session header"
        raise BadRequest(
            f"the session key in {where} is {len(raw)} bytes; at most {max_bytes} are accepted",
            param=param,
        )
    return xxhash.xxh3_128_hexdigest(raw)


def session_key_of(
    body: Mapping[str, Any],
    header: str | bytes | None,
    fields: Sequence[str],
    max_bytes: int = DEFAULT_LIMITS.max_session_key_bytes,
) -> str | None:
    """The session key (the header, else the first of ``fields`` holding a non-empty
    string) as 32 hex digits of xxh3-128: what the router keeps and hashes per session is
    the same size whatever the client sent."""
    if header:
        return _session_digest(header, None, max_bytes)
    for name in fields:
        value = body.get(name)
        if isinstance(value, str) and value:
            return _session_digest(value, name, max_bytes)
    return None


@dataclass(frozen=True, slots=True)
class RequestBody:
    """A client request read and checked, before its prefix key is computed."""

    kind: Kind
    model: str
    raw: bytes
    fields: Mapping[str, Any]  # the parsed body
    stream: bool
    session_key: str | None
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
    session_header: str | bytes | None,
    session_fields: Sequence[str],
    limits: RequestLimits = DEFAULT_LIMITS,
) -> RequestBody:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    convert = CONVERTED.get(kind)
    if convert is not None:
        view = convert(body)
        return _converted(kind, raw, body, view, session_header, session_fields, limits)
    model = _model(body)
    stream = _stream(body)
    session_key = session_key_of(body, session_header, session_fields, limits.max_session_key_bytes)
    chat = kind == "chat"
    return RequestBody(
        kind=kind,
        model=model,
        raw=raw,
        fields=body,
        stream=stream,
        session_key=session_key,
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
    session_header: str | bytes | None,
    session_fields: Sequence[str],
    limits: RequestLimits,
) -> RequestBody:
    """A Responses or Messages request, keyed as the chat request ``chat``."""
    max_bytes = limits.max_session_key_bytes
    session_key = session_key_of(body, session_header, session_fields, max_bytes) or session_key_of(
        chat.own_session, None, OWN_SESSION, max_bytes
    )
    messages = chat.fields["messages"]
    model = _model(chat.fields)
    return RequestBody(
        kind=kind,
        model=model,
        raw=raw,
        fields=body,
        stream=_stream(body),
        session_key=session_key,
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
        return _client_request(body, cut, chain.blocks, record_reply=False, cut=True)
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
    cut: bool = False,
) -> ClientRequest:
    return ClientRequest(
        kind=body.kind,
        model=body.model,
        body=body.raw,
        stream=body.stream,
        session_key=body.session_key,
        key=key,
        record_reply=record_reply,
        history_blocks=min(history_blocks, len(key.hashes)),
        continues=body.continues,
        reply_tokens=reply_tokens,
        link=body.link,
        cut=cut,
    )


def parse_request(
    kind: Kind,
    raw: bytes,
    session_header: str | bytes | None,
    session_fields: Sequence[str],
    block_bytes: int,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> ClientRequest:
    """Read, check and key a request by its text (``read_request``, ``keyed_by_text``)."""
    body = read_request(kind, raw, session_header, session_fields, limits)
    return keyed_by_text(body, block_bytes)
