"""Prefix keys from the model's own tokens (``prefix.tokenizer``).

A chat request's messages are rendered with the model's chat template and encoded with
its tokenizer, as the engine does; the canonical bytes are the ids, 4 little-endian
bytes each (as a prompt given as token ids already is, ``router.prefix.render_prompt``),
so a block of ``prefix.block_bytes`` is ``block_bytes / 4`` of the engine's tokens and
the prompt's token count is exact.

Encoding runs on a thread of its own, never on the event loop: a 100K-token prompt seen
for the first time takes a few hundred milliseconds to encode whole (``kvrouter bench
tokenize``). One thread, so the encoder's cache of earlier prompts needs no lock; what
it costs a request is measured beside the text mode's.
"""

from __future__ import annotations

import asyncio
import sys
import time
from array import array
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from router.errors import BadRequest
from router.parse import ClientRequest, RequestBody, keyed, keyed_by_text
from router.tokens.conversation import (
    ContentFormat,
    detect_content_format,
    template_conversation,
    template_tools,
)
from router.tokens.incremental import IncrementalEncoder
from router.tokens.model import ModelTokenizer

TOKEN_BYTES = 4


@dataclass(frozen=True, slots=True)
class ChatTokens:
    canonical: bytes  # the ids, TOKEN_BYTES each
    history_bytes: int  # of them, the previous turn's prompt (router.prefix's sense)
    reused_tokens: int  # taken from an earlier prompt without encoding


class TokenMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "kvrouter_prefix_tokenized_requests",
            "Chat requests keyed by the model's own tokens (prefix.tokenizer), by result: "
            "tokens, or text (the template could not render them or the request asked "
            "for what the router does not render, e.g. continue_final_message; the "
            "engine decides whether they are valid).",
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
        for result in ("tokens", "text"):
            self.requests.labels(result)


class TokenKeys:
    def __init__(
        self,
        model: ModelTokenizer,
        max_tokens: int,
        metrics: TokenMetrics,
        content_format: ContentFormat | None = None,
    ) -> None:
        self.model = model
        self.metrics = metrics
        self._content_format = content_format  # None: read from the template
        self._encoder = IncrementalEncoder(model, max_tokens)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrouter-tokens")

    async def key(self, body: RequestBody, block_bytes: int) -> ClientRequest:
        """A chat request keyed by its tokens; by its text where they cannot be had."""
        assert body.messages is not None
        fields = body.fields
        tools = fields.get("tools")
        tools = tools if isinstance(tools, list) and tools else None
        kwargs = template_kwargs_of(fields)
        if kwargs is None or (tools and not all(isinstance(t, Mapping) for t in tools)):
            self.metrics.requests.labels("text").inc()
            return keyed_by_text(body, block_bytes)
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", True))
        try:
            chat = await self.chat(body.messages, tools, kwargs, add_generation_prompt)
        except (BadRequest, TypeError, ValueError, KeyError, AttributeError, RecursionError):
            # Whatever the router cannot render, the engine may: it decides, the router
            # routes such a request by its text.
            self.metrics.requests.labels("text").inc()
            return keyed_by_text(body, block_bytes)
        self.metrics.requests.labels("tokens").inc()
        return keyed(body, chat.canonical, chat.history_bytes // block_bytes, block_bytes, False)

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
        text = template.render(
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=kwargs,
        )
        encoded = self._encoder.encode(text)
        canonical = _as_bytes(encoded.ids)
        history = _history(messages)
        history_bytes = 0
        if history:
            # The previous turn's prompt as that turn sent it: what it left cached, as far
            # as this prompt still starts with it (a template may rewrite earlier turns).
            before = template.render(
                history[0],
                tools=tools,
                documents=documents,
                add_generation_prompt=history[1],
                template_kwargs=kwargs,
            )
            earlier = _as_bytes(self._encoder.encode(before).ids)
            history_bytes = _common_prefix(canonical, earlier) // TOKEN_BYTES * TOKEN_BYTES
        metrics = self.metrics
        metrics.seconds.observe(time.perf_counter() - started)
        metrics.reused.inc(encoded.reused)
        metrics.encoded.inc(len(encoded.ids) - encoded.reused)
        return ChatTokens(canonical, history_bytes, encoded.reused)


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


def _as_bytes(ids: array[int]) -> bytes:
    if sys.byteorder == "big":
        ids = array("I", ids)
        ids.byteswap()
    return ids.tobytes()


def _common_prefix(a: bytes, b: bytes) -> int:
    """Length of the longest common prefix, by halving (each step one C comparison)."""
    if a.startswith(b):
        return len(b)
    low, high = 0, min(len(a), len(b))
    view_a, view_b = memoryview(a), memoryview(b)
    while low < high:
        middle = (low + high + 1) // 2
        if view_a[:middle] == view_b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
