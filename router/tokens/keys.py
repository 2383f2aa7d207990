"""Prefix keys from the model's own tokens (``prefix.tokenizer``).

A chat request's messages are rendered with the model's chat template and encoded with
its tokenizer, as the engine does (a completion's text prompt is encoded as it is, with
the tokenizer's special tokens unless ``add_special_tokens`` is false; its token ids are
taken as they are); the canonical bytes are the ids, 4 little-endian bytes each
(``router.index.prefix.token_bytes``), so a block of ``prefix.block_bytes`` is ``block_bytes /
4`` of the engine's tokens, the prompt's token count is exact, and the blocks are the
ones the engine's KV events announce (router.kv_events).

Encoding runs on a thread of its own, never on the event loop: a 100K-token prompt seen
for the first time takes a few hundred milliseconds to encode whole (``kvrouter bench
tokenize``). One thread, so the encoder's cache of earlier prompts needs no lock; what
it costs a request is measured beside the text mode's.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AnyStr, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram

from router.apis.request import (
    ClientRequest,
    RequestBody,
    keyed,
    keyed_after,
    keyed_by_text,
    new_input,
)
from router.config import DEFAULT_MAX_TOKENIZED_BYTES
from router.index.stored_chain import StoredChain
from router.tokens.continuation import continuation_ids
from router.tokens.conversation import (
    ContentFormat,
    detect_content_format,
    renders_as_the_engine,
    template_conversation,
    template_tools,
)
from router.tokens.incremental import Encoded, IncrementalEncoder
from router.tokens.model import ModelTokenizer
from router.wire.blocks import TOKEN_BYTES, token_bytes

# Requests queued for the tokenizer's thread past which the next is keyed by its text:
# waiting behind many long first prompts would cost more than a coarser key.
MAX_PENDING = 64
# Rendering and encoding hold the interpreter for parts of their work (the template, the
# ids turned into a list), so what one request may ask of them is bounded: a body over
# ``prefix.max_tokenized_bytes`` or with more messages and content parts than this is
# keyed by its text. A long agent session is a few hundred messages.
MAX_TOKENIZED_ITEMS = 4096
# Request fields that change what the engine renders or encodes in ways the router does
# not reproduce: a request that sets them is keyed by its text.
UNRENDERED_FIELDS = ("chat_template", "truncate_prompt_tokens")
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChatTokens:
    canonical: bytes  # the ids, TOKEN_BYTES each
    history_bytes: int  # of them, the previous turn's prompt (router.index.prefix's sense)
    reused_tokens: int  # taken from an earlier prompt without encoding


class TokenMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "kvrouter_prefix_tokenized_requests",
            "Requests keyed by the model's own tokens (prefix.tokenizer), by result: "
            "tokens; text (the template could not render them, or the request asked for "
            "what the router does not render: continue_final_message, its own "
            "chat_template, media parts...; the engine decides whether they are valid); "
            "busy (too many waiting for the tokenizer, keyed by text instead); too_large "
            "(over prefix.max_tokenized_bytes, or too many messages and parts).",
            ["result"],
            registry=registry,
        )
        self.seconds = Histogram(
            "kvrouter_prefix_tokenize_seconds",
            "Time to render and encode a chat prompt (on the tokenizer's thread).",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=registry,
        )
        self.reused = Counter(
            "kvrouter_prefix_reused_tokens",
            "Prompt tokens taken from an earlier prompt's encoding instead of encoded again.",
            registry=registry,
        )
        self.encoded = Counter(
            "kvrouter_prefix_encoded_tokens", "Prompt tokens encoded.", registry=registry
        )
        for result in ("tokens", "text", "busy", "too_large"):
            self.requests.labels(result)


class PromptKeys(Protocol):
    """How prompts are keyed by tokens: the model's files here, or a worker's /tokenize
    (router.tokens.engine)."""

    async def key(self, body: RequestBody, block_bytes: int) -> ClientRequest: ...

    async def continued(
        self, body: RequestBody, chain: StoredChain, block_bytes: int
    ) -> ClientRequest | None:
        """A Responses request continuing the conversation ``chain`` (keyed by tokens,
        fitting the request), keyed as that conversation followed by its input; None
        where its input's tokens cannot be had."""

    async def reply_tokens(self, text: str) -> bytes | None:
        """A reply's text in the model's tokens, 4 bytes each; None where not known."""

    def close(self) -> None: ...


class TokenKeys:
    def __init__(
        self,
        model: ModelTokenizer,
        max_tokens: int,
        metrics: TokenMetrics,
        content_format: ContentFormat | None = None,
        max_bytes: int = DEFAULT_MAX_TOKENIZED_BYTES,
    ) -> None:
        self.model = model
        self.metrics = metrics
        self._max_bytes = max_bytes
        self._content_format = content_format  # None: read from the template
        self._encoder = IncrementalEncoder(model, max_tokens)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrouter-tokens")
        self._pending = 0  # requests waiting for or on the tokenizer's thread

    async def key(self, body: RequestBody, block_bytes: int) -> ClientRequest:
        """A request keyed by its tokens; by its text where they cannot be had (the
        engine, not the router, decides whether such a request is valid)."""
        if self._too_large(body):
            return self._by_text(body, block_bytes, "too_large")
        if body.messages is None:
            return await self._completion(body, block_bytes)
        inputs = template_inputs(body)
        if inputs is None:
            return self._by_text(body, block_bytes, "text")
        if self._pending >= MAX_PENDING:
            return self._by_text(body, block_bytes, "busy")
        tools, kwargs = inputs
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", True))
        self._pending += 1
        try:
            chat = await self.chat(body.messages, tools, kwargs, add_generation_prompt)
        except asyncio.CancelledError:
            raise
        except Exception:  # a template error, or anything else the router cannot render
            log.debug("chat prompt keyed by its text", exc_info=True)
            return self._by_text(body, block_bytes, "text")
        finally:
            self._pending -= 1
        self.metrics.requests.labels("tokens").inc()
        history = chat.history_bytes // block_bytes
        return keyed(body, chat.canonical, history, block_bytes, False, reply_tokens=True)

    async def continued(
        self, body: RequestBody, chain: StoredChain, block_bytes: int
    ) -> ClientRequest | None:
        """What the template writes after the stored reply, encoded on the tokenizer's
        thread (``router.tokens.continuation``) and added to the chain."""
        assert body.messages is not None and body.link is not None
        inputs = template_inputs(body)
        if inputs is None or self._too_large(body) or self._pending >= MAX_PENDING:
            return None
        tools, kwargs = inputs
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", True))
        instructions = body.messages[: body.link.input_from]
        loop = asyncio.get_running_loop()
        self._pending += 1
        try:
            ids = await loop.run_in_executor(
                self._thread,
                continuation_ids,
                self.model,
                self._content_format,
                instructions,
                new_input(body),
                tools,
                kwargs,
                add_generation_prompt,
            )
        except asyncio.CancelledError:
            raise
        except Exception:  # a template error: the engine decides whether it is valid
            log.debug("a continuation's input did not render", exc_info=True)
            return None
        finally:
            self._pending -= 1
        if ids is None:
            return None
        self.metrics.requests.labels("tokens").inc()
        self.metrics.encoded.inc(len(ids))
        return keyed_after(body, chain, token_bytes(ids), block_bytes)

    async def _completion(self, body: RequestBody, block_bytes: int) -> ClientRequest:
        """A completion's prompt as the engine encodes it (vLLM: ``add_special_tokens``,
        default true); a prompt of token ids is the engine's tokens already."""
        prompt = body.prompt
        assert prompt is not None
        if isinstance(prompt, str):
            special = body.fields.get("add_special_tokens", True)
            truncated = body.fields.get("truncate_prompt_tokens") is not None
            if not isinstance(special, bool) or truncated:
                return self._by_text(body, block_bytes, "text")
            if self._pending >= MAX_PENDING:
                return self._by_text(body, block_bytes, "busy")
            self._pending += 1
            try:
                loop = asyncio.get_running_loop()
                ids = await loop.run_in_executor(self._thread, self._encode, prompt, special)
            finally:
                self._pending -= 1
        else:
            ids = list(prompt)
        self.metrics.requests.labels("tokens").inc()
        return keyed(body, token_bytes(ids), 1, block_bytes, False)

    def _too_large(self, body: RequestBody) -> bool:
        """More than the tokenizer is given for one request (``MAX_TOKENIZED_ITEMS``)."""
        if len(body.raw) > self._max_bytes:
            return True
        if body.messages is None:
            return False
        items = len(body.messages)
        for message in body.messages:
            content = message.get("content")
            if isinstance(content, list):
                items += len(content)
            if items > MAX_TOKENIZED_ITEMS:
                return True
        return False

    async def reply_tokens(self, text: str) -> bytes | None:
        if len(text) > self._max_bytes:
            return None
        loop = asyncio.get_running_loop()
        return token_bytes(await loop.run_in_executor(self._thread, self._encode, text, False))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        started = time.perf_counter()
        encoding = self.model.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        ids: list[int] = encoding[0].ids
        self.metrics.seconds.observe(time.perf_counter() - started)
        self.metrics.encoded.inc(len(ids))
        return ids

    def _by_text(self, body: RequestBody, block_bytes: int, result: str) -> ClientRequest:
        self.metrics.requests.labels(result).inc()
        return keyed_by_text(body, block_bytes)

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        add_generation_prompt: bool = True,
    ) -> ChatTokens:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._thread, self._chat, messages, tools, template_kwargs, add_generation_prompt
        )

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        add_generation_prompt: bool,
    ) -> ChatTokens:
        started = time.perf_counter()
        template = self.model.template(with_tools=bool(tools))
        content_format = self._content_format or detect_content_format(template.source)
        messages = template_conversation(messages, content_format, template.source)
        tools = template_tools(tools) if tools else None
        kwargs = dict(template_kwargs or {})
        documents = kwargs.pop("documents", None)

        def render(conversation: Sequence[Mapping[str, Any]], generation_prompt: bool) -> str:
            return template.render(
                conversation,
                tools=tools,
                documents=documents,
                add_generation_prompt=generation_prompt,
                template_kwargs=kwargs,
            )

        text = render(messages, add_generation_prompt)
        encoded = self._encoder.encode(text)
        canonical = token_bytes(encoded.ids)
        history = _history(messages)
        history_bytes = 0
        if history:
            try:
                history_bytes = self._history_bytes(history, text, encoded, canonical, render)
            except Exception:  # a template may refuse the shorter conversation
                log.debug("the previous turn's prompt did not render", exc_info=True)
        metrics = self.metrics
        metrics.seconds.observe(time.perf_counter() - started)
        metrics.reused.inc(encoded.reused)
        metrics.encoded.inc(len(encoded.ids) - encoded.reused)
        return ChatTokens(canonical, history_bytes, encoded.reused)

    def _history_bytes(
        self,
        history: tuple[Sequence[Mapping[str, Any]], bool],
        text: str,
        encoded: Encoded,
        canonical: bytes,
        render: Callable[[Sequence[Mapping[str, Any]], bool], str],
    ) -> int:
        """The previous turn's prompt as that turn sent it: what it left cached, as far
        as this prompt still starts with it (a template may rewrite earlier turns)."""
        before = render(*history)
        shared = _common_prefix(before, text)
        if shared >= encoded.start:  # within what was just encoded: its offsets say
            tokens = encoded.reused + bisect.bisect_right(encoded.ends, shared - encoded.start)
            return tokens * TOKEN_BYTES
        earlier = token_bytes(self._encoder.encode(before).ids)
        return _common_prefix(canonical, earlier) // TOKEN_BYTES * TOKEN_BYTES


def template_inputs(
    body: RequestBody,
) -> tuple[list[Mapping[str, Any]] | None, dict[str, Any]] | None:
    """A chat request's tools and template kwargs (``template_kwargs_of``), where the
    router renders its prompt as the engine does; None where it does not."""
    assert body.messages is not None
    fields = body.rendered_fields
    tools = fields.get("tools")
    tools = tools if isinstance(tools, list) and tools else None
    kwargs = template_kwargs_of(fields)
    if kwargs is None or not renders_as_the_engine(body.messages):
        return None
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        return None
    return tools, kwargs


def template_kwargs_of(fields: Mapping[str, Any]) -> dict[str, Any] | None:
    """What vLLM (v0.33, ``ChatCompletionRequest.build_chat_params``) gives the template
    besides the messages and tools: the request's ``chat_template_kwargs``, overridden by
    its own fields (``add_generation_prompt``, ``documents``, ``reasoning_effort``, and
    ``enable_thinking`` from a reasoning effort the kwargs do not settle). None where
    the router does not render what the engine would: ``continue_final_message``, or
    kwargs that are not an object."""
    given = fields.get("chat_template_kwargs")
    if given is not None and not isinstance(given, Mapping):
        return None
    if any(fields.get(name) is not None for name in UNRENDERED_FIELDS) or fields.get(
        "add_special_tokens"
    ):
        return None
    user = dict(given or {})
    if fields.get("continue_final_message") or user.get("continue_final_message"):
        return None
    effort = fields.get("reasoning_effort")
    extra: dict[str, Any] = {
        "add_generation_prompt": fields.get("add_generation_prompt", True),
        "documents": fields.get("documents"),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = effort != "none"
    user.pop("continue_final_message", None)
    user.update({k: v for k, v in extra.items() if v is not None and v != "auto"})
    return user


def _history(
    messages: Sequence[Mapping[str, Any]],
) -> tuple[Sequence[Mapping[str, Any]], bool] | None:
    """The messages of the previous turn's prompt, and whether it ended with the
    generation prompt: everything before the last assistant message, or, in a session's
    first turn, before its last message (a system prompt others may share)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            return (messages[:i], True) if i else None
    return (messages[:-1], False) if len(messages) > 1 else None


def _common_prefix(a: AnyStr, b: AnyStr) -> int:
    """Length of the longest common prefix, by halving (each step one C comparison)."""
    if a.startswith(b):
        return len(b)
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
