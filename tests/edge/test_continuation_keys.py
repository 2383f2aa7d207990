"""A request continuing a stored response, keyed by text from the conversation's chain as
the router keeps it: the same key as the chat request of the whole conversation, as
vLLM renders it (instructions, the stored messages without their system messages, the
reply's message text without its function calls, the new input)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.apis.capture import ReplyCapture
from router.apis.request import (
    ClientRequest,
    keyed_after,
    keyed_continuing,
    parse_request,
    read_request,
)
from router.apis.responses_reply import ResponsesCapture
from router.edge.settlement import conversation_chain
from router.index.prefix import CHAT_REPLY_HEADER, ChainExtender
from router.index.stored_chain import StoredChain
from router.wire.kinds import Kind

BLOCK_BYTES = 64
SYSTEM = "You are a coding agent. " * 20
ASK = "Read a.py and tell me what it does. " * 5
REPLY = "It prints one, then reads the configuration file it was given. " * 3
CALL = {"type": "function_call", "call_id": "c1", "name": "read", "arguments": '{"p": 1}'}
FIRST = {"model": "m", "instructions": SYSTEM, "input": ASK}


def keyed(body: dict[str, Any], kind: Kind = "responses") -> ClientRequest:
    return parse_request(kind, orjson.dumps(body), BLOCK_BYTES)


def message(*texts: str) -> dict[str, Any]:
    parts = [{"type": "output_text", "text": t} for t in texts]
    return {"type": "message", "role": "assistant", "content": parts}


async def replied(request: ClientRequest, output: list[dict[str, Any]]) -> ReplyCapture:
    """The request's whole reply read and settled, as the relay does."""
    capture = ResponsesCapture(ChainExtender(request.key, BLOCK_BYTES, CHAT_REPLY_HEADER))
    capture.feed_whole(orjson.dumps({"id": "resp_1", "object": "response", "output": output}))
    await capture.settle()
    capture.reply_hashes()  # what the index takes: the function calls too
    return capture


async def stored(request: ClientRequest, output: list[dict[str, Any]]) -> StoredChain:
    chain = conversation_chain(request, await replied(request, output), BLOCK_BYTES)
    assert chain is not None
    return chain


def continuing(chain: StoredChain, **fields: Any) -> ClientRequest:
    body = {"model": "m", "instructions": SYSTEM, "previous_response_id": "resp_1", **fields}
    read = read_request("responses", orjson.dumps(body))
    assert read.link is not None and chain.fits(read.seed, read.link.context, BLOCK_BYTES)
    return keyed_continuing(read, chain, BLOCK_BYTES)


def chat(*messages: dict[str, Any]) -> ClientRequest:
    system = {"role": "system", "content": SYSTEM}
    return keyed({"model": "m", "messages": [system, *messages]}, "chat")


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


async def test_follow_ups_are_keyed_as_the_whole_conversation() -> None:
    first = keyed(FIRST)
    chain = await stored(first, [message(REPLY), CALL])
    second = continuing(chain, input="And b.py?")
    conversation = [user(ASK), assistant(REPLY), user("And b.py?")]  # no function call
    assert second.key == chat(*conversation).key
    assert second.record_reply and second.history_blocks == chain.blocks > 0
    third = continuing(await stored(second, [message("It is empty.")]), input="Thanks.")
    assert third.key == chat(*conversation, assistant("It is empty."), user("Thanks.")).key


async def test_a_reply_of_function_calls_alone_adds_nothing_to_the_conversation() -> None:
    first = keyed(FIRST)
    result = {"type": "function_call_output", "call_id": "c1", "output": "print(1)"}
    follow = continuing(await stored(first, [CALL]), input=[result])
    tool = {"role": "tool", "content": "print(1)", "tool_call_id": "c1"}
    assert follow.key == chat(user(ASK), tool).key


async def test_a_reply_of_several_parts_leaves_the_conversation_unknown() -> None:
    first = keyed(FIRST)
    assert conversation_chain(first, await replied(first, [message("a", "b")]), BLOCK_BYTES) is None


@pytest.mark.parametrize(
    "changed",
    [
        {"instructions": "Other instructions."},
        {"tools": [{"type": "function", "name": "read", "parameters": {}}]},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"cache_salt": "tenant-2"},
    ],
    ids=["instructions", "tools", "template", "salt"],
)
async def test_a_follow_up_that_renders_its_start_otherwise_does_not_fit(
    changed: dict[str, Any],
) -> None:
    chain = await stored(keyed(FIRST), [message(REPLY)])
    body = {**FIRST, "previous_response_id": "resp_1", "input": "And b.py?", **changed}
    read = read_request("responses", orjson.dumps(body))
    assert read.link is not None
    assert not chain.fits(read.seed, read.link.context, BLOCK_BYTES)


async def test_a_router_keying_other_blocks_does_not_continue_a_chain() -> None:
    chain = await stored(keyed(FIRST), [message(REPLY)])
    read = read_request("responses", orjson.dumps({**FIRST, "input": "b"}))
    assert read.link is not None
    assert chain.fits(read.seed, read.link.context, BLOCK_BYTES)
    assert not chain.fits(read.seed, read.link.context, 2 * BLOCK_BYTES)


@pytest.mark.parametrize(
    "first",
    [
        {**FIRST, "input": [{"role": "system", "content": "Be brief."}, user(ASK)]},
        {**FIRST, "store": False},
    ],
    ids=["system-input", "not-stored"],
)
async def test_a_conversation_no_follow_up_extends_keeps_no_chain(first: dict[str, Any]) -> None:
    """vLLM drops the stored messages' system messages; an unstored one is not there."""
    request = keyed(first)
    assert conversation_chain(request, await replied(request, [message(REPLY)]), 64) is None


async def test_a_cut_conversation_keys_its_follow_ups_by_the_blocks_kept() -> None:
    first = keyed(FIRST)
    whole = await stored(first, [message(REPLY)])
    cut = StoredChain.of(whole.key(), "text", BLOCK_BYTES, whole.context, max_blocks=3)
    follow = continuing(cut, input="And b.py?")
    assert follow.cut and not follow.record_reply
    assert follow.key.hashes == whole.key().hashes[:3] and follow.history_blocks == 3
    assert follow.key.total_bytes > whole.total_bytes
    # Its reply cannot extend it: what it leaves is the same cut chain, on and on.
    again = conversation_chain(follow, await replied(follow, [message("More.")]), BLOCK_BYTES)
    assert again is not None and not again.whole and again.key().hashes == follow.key.hashes


async def test_a_cut_chain_keyed_by_tokens_stays_one() -> None:
    """A follow-up of a cut token chain leaves the same cut chain, still of tokens: its
    size is counted in token bytes, not text's."""
    whole = await stored(keyed(FIRST), [message(REPLY)])
    cut = StoredChain.of(whole.key(), "tokens", BLOCK_BYTES, whole.context, max_blocks=3)
    body = {"model": "m", "instructions": SYSTEM, "previous_response_id": "r", "input": "b"}
    follow = keyed_after(read_request("responses", orjson.dumps(body)), cut, b"ids", BLOCK_BYTES)
    assert follow.cut and not follow.reply_tokens and not follow.record_reply
    again = conversation_chain(follow, await replied(follow, [message("More.")]), BLOCK_BYTES)
    assert again is not None and again.keyed_by == "tokens" and not again.whole
