"""A model's chat template, rendered to the very text the engine renders.

vLLM renders a chat request with transformers' ``apply_chat_template(tokenize=False)``:
the template compiled in a sandboxed Jinja2 environment (``trim_blocks``,
``lstrip_blocks``, the ``loopcontrols`` extension and a ``{% generation %}`` tag), with
its own ``tojson`` (no HTML escaping, non-ASCII kept) and the globals
``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``; the tokenizer's
special tokens (``eos_token``, ``pad_token``, ...) are template variables, and the
request's keyword arguments override them. One character of difference and every
token after it differs, so this is that environment, as transformers 5 builds it
(``transformers/utils/chat_template_utils.py``), and ``tests/index/test_tokens.py`` holds
it to transformers' own output.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import jinja2.utils

from router.errors import BadRequest

# The names a message's reasoning arrives under; templates read ``reasoning_content``
# (and gpt-oss's ``thinking``), so transformers fills both from whichever is given.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplate:
    """One compiled template; ``render`` is safe to call from any number of requests."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._template = _compile(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages``; a template that raises (its own
        ``raise_exception``, or a message it cannot take) is the request's fault."""
        variables = {**self.special_tokens, **(template_kwargs or {})}
        try:
            return self._template.render(
                messages=[_as_template_sees(m) for m in messages],
                tools=list(tools) if tools is not None else None,
                documents=list(documents) if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise BadRequest(
                f"the model's chat template refused the messages: {exc}", "messages"
            ) from exc
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            raise BadRequest(
                f"the model's chat template failed on the messages: {exc}", "messages"
            ) from exc


def _as_template_sees(message: Mapping[str, Any]) -> dict[str, Any]:
    """What transformers passes for one message: keys whose value is None dropped (many
    templates print "None" otherwise), reasoning filled in under every name templates read."""
    plain = {key: value for key, value in message.items() if value is not None}
    reasoning = next((plain[key] for key in REASONING_FIELDS if key in plain), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training
    masks; rendering a prompt only needs its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it so)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` without underscore-prefixed attributes (a sandbox escape)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own signature
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set {name!r} on a namespace"
            )


class _Dict:
    """``dict(...)`` for templates, without the type's attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Python's json, not orjson: templates rely on its spacing (", " and ": ").
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def parse_template(source: str) -> jinja2.nodes.Template:
    """The template's syntax tree, parsed as it is compiled (its tags known)."""
    return _environment().parse(source)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


@functools.cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _Dict()
    environment.globals["namespace"] = _Namespace
    return environment
