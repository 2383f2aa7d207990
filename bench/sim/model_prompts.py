"""A model directory's tokenizer and chat template in the simulated engine
(``--tokenizer DIR``), so that its prompts are the ids vLLM would compute.

vLLM renders a chat request with transformers' ``apply_chat_template`` and encodes the
text without the tokenizer's special tokens (the template writes them); a completion's
text is encoded with them unless ``add_special_tokens`` is false. The rendering is the
router's own (``router/tokens/``: the same template environment, the same conversation
vLLM builds from the messages, held equal to transformers by ``tests/index/test_tokens.py``);
``continue_final_message`` is transformers' (the final message tagged, the text cut at
the tag).

Rendering and encoding run on one thread of their own, never on the event loop: a 100K-
token prompt encoded whole takes ~170 ms. Chat prompts go through the router's
``IncrementalEncoder``, which encodes only the text after the longest earlier prompt's
cut (a session's next turn) and gives the ids a whole encoding gives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from bench.sim.prompts import ChatInput, check_template_options
from bench.sim.reply_words import ModelWords, ReplyWords
from bench.sim.request_fields import ApiError
from router.errors import BadRequest
from router.tokens.conversation import (
    detect_content_format,
    renders_as_the_engine,
    template_conversation,
    template_tools,
)
from router.tokens.incremental import IncrementalEncoder
from router.tokens.keys import template_kwargs_of
from router.tokens.model import ModelTokenizer
from router.wire.blocks import token_bytes

T = TypeVar("T")
# What the incremental encoder keeps of earlier prompts to start later ones from, in
# charged tokens (ids, and each prompt's PROMPT_OVERHEAD_TOKENS): ~16 MB.
CACHE_TOKENS = 4_000_000
# transformers' marker for the end of the message ``continue_final_message`` leaves open.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Request fields this module reads itself; ``template_kwargs_of`` (the router's, which
# does not render them) would refuse a request that sets them.
_READ_HERE = ("continue_final_message", "add_special_tokens", "chat_template")


class ModelPrompts:
    """``bench.sim.prompts.Prompts`` with a model's tokenizer and chat template."""

    def __init__(self, model: ModelTokenizer, cache_tokens: int = CACHE_TOKENS) -> None:
        self.model = model
        self.vocab_size: int = model.tokenizer.get_vocab_size(with_added_tokens=True)
        self.reply_words: ReplyWords = ModelWords.of(model)
        self._encoder = IncrementalEncoder(model, cache_tokens)
        # One thread: the encoder's cache of earlier prompts needs no lock.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sim-tokenizer")

    @classmethod
    def load(cls, directory: str | Path) -> ModelPrompts:
        """Read the directory (``router.errors.ConfigError`` when it cannot be used)."""
        return cls(ModelTokenizer.from_dir(directory))

    async def chat(self, chat: ChatInput) -> bytes:
        return await self._on_thread(self._chat, chat)

    async def text(self, text: str, add_special_tokens: bool) -> bytes:
        return await self._on_thread(self._text, text, add_special_tokens)

    async def token_strs(self, ids: Sequence[int]) -> list[str]:
        tokenizer = self.model.tokenizer
        return await self._on_thread(lambda: [tokenizer.id_to_token(i) or "" for i in ids])

    async def decode(self, ids: Sequence[int]) -> str:
        # transformers' decode keeps special tokens unless told otherwise; tokenizers'
        # drops them by default.
        tokenizer = self.model.tokenizer
        return await self._on_thread(lambda: str(tokenizer.decode(ids, skip_special_tokens=False)))

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def _on_thread(self, work: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, work, *args)

    def _chat(self, chat: ChatInput) -> bytes:
        text = self.render(chat)
        if chat.add_special_tokens:
            return self._text(text, True)
        return token_bytes(self._encoder.encode(text).ids)

    def _text(self, text: str, add_special_tokens: bool) -> bytes:
        # encode_batch, not encode: only it lets go of the GIL while it works.
        encoding = self.model.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return token_bytes(encoding[0].ids)

    def render(self, chat: ChatInput) -> str:
        """The prompt text vLLM renders for ``chat``; ``ApiError`` 400 for what the
        template refuses."""
        check_template_options(chat.body)  # the stand-in ignores them, this template not
        if not renders_as_the_engine(chat.messages):
            raise ApiError(400, "only text content parts are simulated", param="messages")
        template = self.model.template(with_tools=bool(chat.tools))
        content_format = detect_content_format(template.source)
        conversation = template_conversation(chat.messages, content_format, template.source)
        kwargs = template_kwargs(chat.body)
        documents = kwargs.pop("documents", None)
        final = ""
        if chat.continue_final_message:
            conversation, final = tag_final_message(conversation, template.source)
        try:
            text = template.render(
                conversation,
                tools=template_tools(chat.tools) if chat.tools else None,
                documents=documents,
                add_generation_prompt=chat.add_generation_prompt,
                template_kwargs=kwargs,
            )
        except BadRequest as exc:
            raise ApiError(400, exc.message, param="messages") from exc
        return cut_at_tag(text, final) if chat.continue_final_message else text


def template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The template's keyword arguments, as vLLM builds them: the request's
    ``chat_template_kwargs`` overridden by its own fields (the router's
    ``template_kwargs_of``), less ``add_generation_prompt`` (passed on its own) and
    ``continue_final_message`` (the request's field decides it, not the kwargs)."""
    fields = {k: v for k, v in body.items() if k not in _READ_HERE}
    given = fields.get("chat_template_kwargs")
    if isinstance(given, Mapping):
        fields["chat_template_kwargs"] = {
            k: v for k, v in given.items() if k != "continue_final_message"
        }
    kwargs = template_kwargs_of(fields)
    if kwargs is None:  # chat_input let through only an object
        raise ApiError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
    kwargs.pop("add_generation_prompt", None)
    return kwargs


def tag_final_message(
    conversation: Sequence[Mapping[str, Any]], template_source: str
) -> tuple[list[dict[str, Any]], str]:
    """The conversation with ``CONTINUE_TAG`` after the last message's text (its last text
    part), and that text: transformers' ``continue_final_message``."""
    last = dict(conversation[-1])
    content = last.get("content")
    if content is None:
        raise ApiError(400, 'continue_final_message is set but the final message has no "content"')
    if "content" not in template_source:
        raise ApiError(400, "continue_final_message is set but the template has no content")
    if isinstance(content, list):
        parts = [dict(part) for part in content]
        for part in reversed(parts):
            if "text" in part:
                final = str(part["text"])
                part["text"] = final + CONTINUE_TAG
                break
        else:
            raise ApiError(400, "continue_final_message is set but the final message has no text")
        last["content"] = parts
    else:
        final = str(content)
        last["content"] = final + CONTINUE_TAG
    return [*map(dict, conversation[:-1]), last], final


def cut_at_tag(rendered: str, final: str) -> str:
    """The rendered text up to the tag (and without the spacing before it, when the
    template trimmed the tag's own)."""
    tag = CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ApiError(
            400,
            "continue_final_message is set but the final message does not appear in the "
            "chat after applying the chat template",
            param="messages",
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()
