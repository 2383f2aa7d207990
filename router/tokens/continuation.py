"""The token ids a request continuing a stored response adds to the stored conversation.

The engine renders such a request as its instructions, the stored conversation, the
stored reply as an assistant message, then the new input (``router.apis.responses_chat``)
through the chat template, and encodes the whole. The router holds the conversation's
chain (its prompt's ids, then its reply's text's ids: ``router.tokens.reply``), not its
text, so it renders a stand-in of the same shape in place of it, a question and a
reply, and takes what the template writes after the reply: the reply's end, the new
input, the generation prompt. That text is the real prompt's end where

* the stand-in's prompt, rendered alone, ends exactly where the reply begins (the
  template writes the reply where the earlier prompt's generation prompt left off,
  which a template that adds a thinking block to the generation prompt alone does not),
  and
* the text after the reply begins with an added token the tokenizer always cuts out
  whole (``ModelTokenizer.boundaries``), so it encodes as it would inside the whole.

Anywhere else there is no answer (the request is keyed blind). A template that renders
earlier turns differently once the conversation grows (Qwen3 drops the reasoning of
turns before the last question) is not seen here: the stored chain stands for the
earlier turns as they were first rendered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.tokens.conversation import (
    ContentFormat,
    detect_content_format,
    template_conversation,
    template_tools,
)
from router.tokens.model import ModelTokenizer

# What stands in for the stored conversation: plain words no template rewrites.
STAND_IN_QUESTION = "stand-in question"
STAND_IN_REPLY = "stand-in reply"


def continuation_ids(
    model: ModelTokenizer,
    content_format: ContentFormat | None,
    instructions: Sequence[Mapping[str, Any]],
    new_input: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    template_kwargs: Mapping[str, Any],
    add_generation_prompt: bool,
) -> list[int] | None:
    """The ids the engine's prompt holds after the stored reply's text; None where the
    template does not let them be told apart (above)."""
    if model.start_sensitive:
        return None
    template = model.template(with_tools=bool(tools))
    form = content_format or detect_content_format(template.source)
    kwargs = dict(template_kwargs)
    documents = kwargs.pop("documents", None)
    rendered_tools = template_tools(tools) if tools else None

    def render(messages: Sequence[Mapping[str, Any]], generation_prompt: bool) -> str:
        return template.render(
            template_conversation(messages, form, template.source),
            tools=rendered_tools,
            documents=documents,
            add_generation_prompt=generation_prompt,
            template_kwargs=kwargs,
        )

    asked = [*instructions, {"role": "user", "content": STAND_IN_QUESTION}]
    replied = [*asked, {"role": "assistant", "content": STAND_IN_REPLY}, *new_input]
    prompt = render(asked, True) + STAND_IN_REPLY
    whole = render(replied, add_generation_prompt)
    if not whole.startswith(prompt):
        return None
    after = whole[len(prompt) :]
    if not after.startswith(model.boundaries):
        return None
    return model.encode(after)
