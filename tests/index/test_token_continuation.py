"""What a request continuing a stored response adds to the conversation's ids
(router.tokens.continuation), held to transformers' ``apply_chat_template`` of the whole
conversation: the stored prompt's ids, the reply's text's ids and these are the ids the
engine encodes, or there is no answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from bench.textgen import text_for
from router.tokens.continuation import continuation_ids
from router.tokens.model import ModelTokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
INSTRUCTIONS = [{"role": "system", "content": "You are terse."}]
EARLIER = [
    {"role": "user", "content": text_for("cont-u0", 60)},
    {"role": "assistant", "content": text_for("cont-a0", 30)},
    {"role": "user", "content": text_for("cont-u1", 40)},
]
REPLY = text_for("cont-a1", 30)
NEW_INPUTS = {
    "a question": [{"role": "user", "content": text_for("cont-u2", 20)}],
    "a tool's output": [{"role": "tool", "content": "print(1)", "tool_call_id": "c1"}],
}


@pytest.fixture(scope="module")
def model(model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.mark.parametrize("new_input", list(NEW_INPUTS))
@pytest.mark.parametrize("with_tools", [False, True])
def test_the_conversations_ids_and_these_are_the_whole_prompts(
    model: ModelTokenizer, reference: Any, new_input: str, with_tools: bool
) -> None:
    tools = TOOLS if with_tools else None
    stored = [*INSTRUCTIONS, *EARLIER]

    def ids(messages: list[dict[str, Any]]) -> list[int]:
        text = reference.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        return list(reference.encode(text, add_special_tokens=False))

    reply = list(reference.encode(REPLY, add_special_tokens=False))
    added = continuation_ids(
        model, None, INSTRUCTIONS, NEW_INPUTS[new_input], tools, {}, add_generation_prompt=True
    )
    whole = [*stored, {"role": "assistant", "content": REPLY}, *NEW_INPUTS[new_input]]
    assert added is not None
    assert ids(stored) + reply + added == ids(whole)


def test_a_generation_prompt_the_reply_does_not_follow_gives_no_answer(
    model: ModelTokenizer,
) -> None:
    """Qwen3 without thinking: the prompt ends with an empty thinking block, which the
    reply's turn, rendered among earlier turns, does not hold."""
    new_input = NEW_INPUTS["a question"]
    thinking_off = {"enable_thinking": False}
    assert continuation_ids(model, None, INSTRUCTIONS, new_input, None, thinking_off, True) is None
    assert continuation_ids(model, None, INSTRUCTIONS, new_input, None, {}, True) is not None
