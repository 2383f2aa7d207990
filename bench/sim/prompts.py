"""A request's prompt in the simulated engine's tokens.

The request's ``messages`` or ``prompt`` is checked here as vLLM checks it, then encoded
by the engine's :class:`Prompts`: :class:`StandInPrompts` (``bench/tokenizer.py``: 4-byte
tokens and a fixed ChatML-shaped template) unless the engine was started with
``--tokenizer DIR`` (``bench/sim/model_prompts.py``: the model's own tokenizer and chat
template, as vLLM renders and encodes them). Either way an encoded prompt is bytes, 4
per token (an id as 4 little-endian bytes), so nothing past the parser (block hashes,
the prefix cache, KV events, ``/tokenize``) knows which encoded it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from bench.sim.reply_words import STAND_IN_WORDS, ReplyWords
from bench.sim.request_fields import ApiError, field, missing
from bench.tokenizer import IM_END, encode_piece, encode_token_ids, render_chat
from router.wire.blocks import TOKEN_BYTES
from router.wire.kinds import PromptKind

_PAD = 0xFF  # the filler a stand-in template piece is padded with; UTF-8 never produces it
STAND_IN_VOCAB = 2**32  # every 4-byte stand-in token is an id
# The end marker of a message, dropped from the last one by ``continue_final_message``.
_MESSAGE_END = encode_piece(IM_END)


@dataclass(frozen=True, slots=True)
class ChatInput:
    """A chat request's checked template inputs; ``body`` for the rest of its fields
    (``chat_template_kwargs``, ``documents``, ``reasoning_effort``)."""

    body: Mapping[str, Any]
    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool


class Prompts(Protocol):
    """How an engine turns text into its tokens and back."""

    @property
    def vocab_size(self) -> int: ...

    async def chat(self, chat: ChatInput) -> bytes:
        """The rendered and encoded chat prompt."""

    async def text(self, text: str, add_special_tokens: bool) -> bytes:
        """A completion's text prompt, encoded."""

    async def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's token as a string (vLLM's ``return_token_strs``)."""

    async def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (``/detokenize``)."""

    @property
    def reply_words(self) -> ReplyWords:
        """What the engine generates in these tokens."""

    def close(self) -> None: ...


class StandInPrompts:
    """The simulator's own tokens (``bench/tokenizer.py``)."""

    vocab_size = STAND_IN_VOCAB
    reply_words: ReplyWords = STAND_IN_WORDS

    async def chat(self, chat: ChatInput) -> bytes:
        if chat.continue_final_message:
            return render_chat(chat.messages, add_generation_prompt=False)[: -len(_MESSAGE_END)]
        return render_chat(chat.messages, add_generation_prompt=chat.add_generation_prompt)

    async def text(self, text: str, add_special_tokens: bool) -> bytes:
        return encode_piece(text)  # the stand-in has no special tokens to add

    async def token_strs(self, ids: Sequence[int]) -> list[str]:
        return [stand_in_text(encode_token_ids([i])) for i in ids]

    async def decode(self, ids: Sequence[int]) -> str:
        return stand_in_text(encode_token_ids(ids))

    def close(self) -> None:
        pass


STAND_IN = StandInPrompts()


def stand_in_text(encoded: bytes) -> str:
    """Stand-in tokens as text: the padding dropped, bytes that are not UTF-8 replaced by
    U+FFFD (as a byte-level tokenizer decodes ids that split a character)."""
    return encoded.replace(bytes([_PAD]), b"").decode("utf-8", errors="replace")


def chat_input(body: Mapping[str, Any], strict: bool = True) -> ChatInput:
    """``messages`` and the options vLLM's chat and tokenize requests read them with:
    ``add_generation_prompt`` (default true) appends the assistant header;
    ``continue_final_message`` (default false) leaves the last message open; the two
    cannot both be on. ``strict`` (``/tokenize``) also refuses a template sent with the
    request, as vLLM does without ``--trust-request-chat-template``, and tools or
    template kwargs of the wrong shape; a chat completion leaves those to the engine's
    ``Prompts`` (the stand-in template reads none of them)."""
    if "messages" not in body:
        raise missing(body, "messages")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "each message needs a string 'role'", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ApiError(
                400, "message 'content' must be a string or a list of parts", param="messages"
            )
    tools = body.get("tools")
    if strict:
        check_template_options(body)
    elif not _objects(tools):
        tools = None
    generation_prompt = field(body, "add_generation_prompt", bool, True)
    continue_final = field(body, "continue_final_message", bool, False)
    if generation_prompt and continue_final:
        raise ApiError(
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    return ChatInput(
        body=body,
        messages=messages,
        tools=tools or None,
        add_generation_prompt=generation_prompt,
        continue_final_message=continue_final,
        add_special_tokens=field(body, "add_special_tokens", bool, False),
    )


def check_template_options(body: Mapping[str, Any]) -> None:
    """A template sent with the request (refused), tools and template kwargs (of the
    right shape), as vLLM checks them."""
    kwargs = field(body, "chat_template_kwargs", dict, {})
    if body.get("chat_template") is not None or kwargs.get("chat_template") is not None:
        raise ApiError(
            400,
            "Chat template is passed with request, but "
            "--trust-request-chat-template is not set. Refused request with "
            "untrusted chat template.",
            param="chat_template",
        )
    if body.get("tools") is not None and not _objects(body["tools"]):
        raise ApiError(400, "'tools' must be a list of objects", param="tools")


def _objects(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(v, dict) for v in values)


def completion_input(body: Mapping[str, Any], allow_token_ids: bool = True) -> str | list[int]:
    """``prompt``: a string, or (when ``allow_token_ids``) a list of 32-bit token ids. A
    batch of one is unwrapped; larger batches are refused."""
    prompt = body.get("prompt")
    if (
        allow_token_ids
        and isinstance(prompt, list)
        and len(prompt) == 1
        and isinstance(prompt[0], str | list)
    ):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if not allow_token_ids:
        raise ApiError(400, "'prompt' must be a string", param="prompt")
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in prompt)
    ):
        return prompt
    raise ApiError(
        400,
        "'prompt' must be a string or a non-empty list of token ids "
        "(batched prompts are not simulated)",
        param="prompt",
    )


async def encode_prompt(
    prompts: Prompts, kind: PromptKind, body: Mapping[str, Any], tokenize: bool = False
) -> bytes:
    """The request's prompt in ``prompts``' tokens. A completion's text gets the
    tokenizer's special tokens unless ``add_special_tokens`` is false (vLLM's default for
    completions); ids are taken as given, if the vocabulary has them. ``tokenize``:
    ``/tokenize``'s stricter reading (``chat_input``; a prompt must be text)."""
    if kind == "chat":
        return await prompts.chat(chat_input(body, strict=tokenize))
    given = completion_input(body, allow_token_ids=not tokenize)
    if isinstance(given, str):
        return await prompts.text(given, field(body, "add_special_tokens", bool, True))
    check_vocab(given, prompts.vocab_size, "prompt")
    return encode_token_ids(given)


def check_vocab(ids: Sequence[int], vocab_size: int, param: str) -> None:
    if ids and max(ids) >= vocab_size:
        raise ApiError(400, f"Token id {max(ids)} is out of vocabulary", param=param)


def num_tokens(encoded: bytes) -> int:
    return len(encoded) // TOKEN_BYTES
