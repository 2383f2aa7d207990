"""Request parsing and response shapes of vLLM's OpenAI-compatible API (simulated), as
vLLM 0.32 answers: ``tests/real/test_sim_vs_vllm.py`` holds them to a real engine's."""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from bench.sim.prompts import STAND_IN, Prompts, encode_prompt
from bench.sim.request_fields import ApiError, field, request_body, requested_model
from bench.tokenizer import CALL_ARGUMENTS_HEAD
from router.wire.kinds import PromptKind

VLLM_VERSION = "0.32.0"


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: PromptKind
    model: str
    prompt: bytes
    max_tokens: int
    exact_length: bool
    stream: bool
    include_usage: bool
    seed: int | None
    cache_salt: str | None
    min_tokens: int
    ignore_eos: bool
    fingerprint: str  # the replies' system_fingerprint
    # The function a chat reply calls (``tool_choice`` "required" or a named function,
    # as vLLM constrains the reply to a call): the generated text becomes its arguments.
    calls: str | None = None
    calls_named: bool = False  # tool_choice names the function (else "required")
    parses_tools: bool = False  # the tool parser reads the reply (tools, tool_choice not none)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt) // 4


async def parse_request(
    kind: PromptKind,
    body: Any,
    served_model: str,
    max_model_len: int,
    prompts: Prompts = STAND_IN,
    tool_calls: bool = True,
    tool_parser: bool = True,
) -> ParsedRequest:
    """A completion request checked as vLLM checks it, its prompt encoded by ``prompts``.
    ``tool_calls``: a chat reply may be a call ``tool_choice`` asks for (not in the
    Messages and Responses APIs, whose replies the simulator writes in text only);
    ``tool_parser``: the engine runs with a tool call parser (else, as vLLM, a
    ``tool_choice`` other than "none" is refused)."""
    body = request_body(body)
    model = requested_model(body, served_model)
    parses_tools = kind == "chat" and _parses_tools(body, tool_parser)
    if field(body, "n", int, 1) != 1:
        raise ApiError(400, "only n=1 is simulated", param="n")
    requested = field(body, "max_completion_tokens", int) or field(body, "max_tokens", int)
    if requested is not None and requested < 1:
        raise _invalid_value(
            f"max_tokens must be at least 1, got {requested}.", "max_tokens", requested
        )
    if requested is not None and requested > max_model_len:
        raise _invalid_value(
            f"max_tokens={requested} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            "max_tokens",
            requested,
        )
    prompt = await encode_prompt(prompts, kind, body)
    prompt_tokens = len(prompt) // 4
    if prompt_tokens > max_model_len:
        # vLLM's tokenizer stops one token past the limit, so it knows no more than that.
        seen = min(prompt_tokens, max_model_len + 1)
        qualifier = "at least " if seen == max_model_len + 1 else ""
        raise _invalid_value(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {qualifier}{seen} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            seen,
        )
    # A reply that would not fit is cut at the context's end, not refused.
    room = max(max_model_len - prompt_tokens, 1)
    max_tokens = room if requested is None else min(requested, room)
    min_tokens = field(body, "min_tokens", int, 0)
    ignore_eos = bool(field(body, "ignore_eos", bool, False))
    stream_options = field(body, "stream_options", dict, {})
    return ParsedRequest(
        calls=_called_function(body) if kind == "chat" and tool_calls else None,
        calls_named=isinstance(body.get("tool_choice"), dict),
        parses_tools=parses_tools,
        kind=kind,
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        exact_length=ignore_eos or min_tokens >= max_tokens,
        stream=bool(field(body, "stream", bool, False)),
        include_usage=bool(stream_options.get("include_usage", False)),
        seed=field(body, "seed", int),
        cache_salt=field(body, "cache_salt", str),
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        fingerprint=system_fingerprint(served_model, max_model_len),
    )


def _parses_tools(body: dict[str, Any], tool_parser: bool) -> bool:
    """Whether the tool parser reads the reply: the request offers tools and does not
    rule calls out. Without a parser, as vLLM 0.32's chat renderer, a ``tool_choice``
    other than "none" (by default "auto" where tools are offered) is refused."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice in (None, "none"):
        return False
    if not tool_parser:
        if choice == "auto":
            raise ApiError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
            )
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            described = f'function "{name}"'
        else:
            described = f'"{choice}"'
        raise ApiError(400, f"tool_choice={described} requires --tool-call-parser to be set")
    return bool(tools)


def _called_function(body: dict[str, Any]) -> str | None:
    """The function ``tool_choice`` makes the reply call: a named one, or with
    "required" the first of ``tools``; None where the model may answer in text."""
    choice = body.get("tool_choice")
    if choice != "required" and not isinstance(choice, dict):
        return None
    tools = body.get("tools")
    names = [
        t["function"]["name"]
        for t in (tools if isinstance(tools, list) else ())
        if isinstance(t, dict)
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
    ]
    if choice == "required":
        if not names:
            raise ApiError(400, 'tool_choice "required" needs a function in tools', param="tools")
        first: str = names[0]
        return first
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or name not in names:
        raise ApiError(400, "tool_choice must name a function in tools", param="tool_choice")
    return name


def call_finish_reason(named: bool, finish_reason: str) -> str:
    """A reply that calls a function ends as vLLM's does: "tool_calls" for a call
    "required" that ended on its own, the generation's own reason otherwise (a named
    call's "stop", a call cut by max_tokens' "length")."""
    return "tool_calls" if not named and finish_reason == "stop" else finish_reason


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_arguments_head() -> str:
    """A call's arguments are ``{"input": <the generated text as a JSON string>}``: the
    part before the text (the stand-in template writes such a call back as the text)."""
    return CALL_ARGUMENTS_HEAD


def call_arguments(text: str) -> str:
    """The JSON of the generated text inside the arguments' string, quotes left off."""
    return orjson.dumps(text).decode()[1:-1]


def _invalid_value(message: str, parameter: str, value: object) -> ApiError:
    """vLLM's ``VLLMValidationError``: the parameter and value close the message."""
    return ApiError(400, f"{message} (parameter={parameter}, value={value})", param=parameter)


@functools.cache
def system_fingerprint(served_model: str, max_model_len: int) -> str:
    """``vllm-<version>-<8 hex digits>``: vLLM's names its version and a digest of its
    configuration."""
    digest = xxhash.xxh32_hexdigest(f"{served_model}\x00{max_model_len}".encode())
    return f"vllm-{VLLM_VERSION}-{digest}"


def new_id(kind: PromptKind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(
    kind: PromptKind,
    stream: bool,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    created_tokens: int,
) -> dict[str, Any]:
    """vLLM 0.32's usage, whose details differ by kind and by whole or streamed reply:
    ``created_cache_tokens`` (the prompt's full blocks written to the cache) is a
    number for chat, null for a whole completion and absent from a streamed one."""
    details: dict[str, Any] = {"cached_tokens": cached_tokens}
    if kind == "chat":
        details["created_cache_tokens"] = created_tokens
    elif not stream:
        details["created_cache_tokens"] = None
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": details,
    }
    if not stream:
        details["multimodal_tokens"] = None
        body["completion_tokens_details"] = None
    return body


def stream_chunk(
    kind: PromptKind,
    rid: str,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None,
    first: bool = False,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0}
    if kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        if finish_reason is not None:
            choice["stop_reason"] = None
        if not first:
            choice["token_ids"] = None
    else:
        choice["text"] = text or ""
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = None
        choice["prompt_token_ids"] = None
        choice["token_ids"] = None
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if first:
        chunk["prompt_token_ids"] = None
        chunk["prompt_text"] = None
    return chunk


def call_chunk(
    rid: str,
    model: str,
    created: int,
    arguments: str | None,
    finish_reason: str | None,
    head: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """A chat chunk of a tool call, as vLLM streams one: the call's head (its id and
    function name, no arguments) in a chunk of its own, then pieces of its arguments."""
    call: dict[str, Any]
    if head is not None:
        call = {"id": head[0], "type": "function", "index": 0, "function": {"name": head[1]}}
    else:
        call = {"index": 0, "function": {"arguments": arguments}}
    chunk = stream_chunk("chat", rid, model, created, None, finish_reason)
    chunk["choices"][0]["delta"] = {"content": None, "tool_calls": [call]}
    return chunk


def sse_event(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


# A text no chunk carries, whose JSON splits a chunk's encoding around its text.
_TEXT_MARK = "\x00"
_TEXT_MARK_JSON = orjson.dumps(_TEXT_MARK)


class ChunkEvents:
    """``sse_event(stream_chunk(...))`` of one stream's text chunks without building and
    encoding the dict each time: the bytes around the text are encoded once per finish
    reason, from ``stream_chunk`` itself, and the text alone is encoded per chunk.
    ``tests/sim/fronts/test_sim_shortcuts.py`` checks the two give the same bytes."""

    __slots__ = ("_created", "_frames", "_kind", "_model", "_rid")

    def __init__(self, kind: PromptKind, rid: str, model: str, created: int) -> None:
        self._kind, self._rid, self._model, self._created = kind, rid, model, created
        self._frames: dict[str | None, tuple[bytes, bytes]] = {}

    def text(self, text: str, finish_reason: str | None) -> bytes:
        frame = self._frames.get(finish_reason)
        if frame is None:
            chunk = stream_chunk(
                self._kind, self._rid, self._model, self._created, _TEXT_MARK, finish_reason
            )
            # The text follows the id and the model, which may hold anything: the last mark.
            head, _, tail = sse_event(chunk).rpartition(_TEXT_MARK_JSON)
            frame = self._frames[finish_reason] = (head, tail)
        return frame[0] + orjson.dumps(text) + frame[1]


def usage_chunk(
    kind: PromptKind,
    rid: str,
    model: str,
    created: int,
    usage_body: dict[str, Any],
    fingerprint: str,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body,
        "system_fingerprint": fingerprint,
    }


def full_response(
    kind: PromptKind,
    rid: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str,
    usage_body: dict[str, Any],
    fingerprint: str,
    calls: str | None = None,
    calls_named: bool = False,
) -> dict[str, Any]:
    if kind == "chat":
        tool_calls: list[dict[str, Any]] = []
        if calls is not None and finish_reason == "length":
            # Cut before the call was whole: vLLM parses no call and answers the raw text.
            text = f'<tool_call>\n{{"name": "{calls}", "arguments": ' + call_arguments_head() + text
        elif calls is not None:
            arguments = call_arguments_head() + call_arguments(text) + '"}'
            function = {"name": calls, "arguments": arguments}
            tool_calls.append({"id": tool_call_id(), "type": "function", "function": function})
            text, finish_reason = "", call_finish_reason(calls_named, finish_reason)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        if tool_calls:  # vLLM leaves the field out of a message that calls none
            message["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None}
        choice |= {"finish_reason": finish_reason, "stop_reason": None, "token_ids": None}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        choice |= {"stop_reason": None, "token_ids": None, "prompt_logprobs": None}
        choice["prompt_token_ids"] = None
    choice["routed_experts"] = None
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage_body,
    }
    if kind == "chat":
        body |= {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
    return body | {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def models_body(model: str, max_model_len: int, owned_by: str) -> dict[str, Any]:
    created = int(time.time())
    permission = {
        # vLLM draws a new id each time; one per model keeps the front ends' bytes alike.
        "id": f"modelperm-{xxhash.xxh64_hexdigest(model.encode())}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": owned_by,
                "root": model,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [permission],
            }
        ],
    }
