"""A model directory's tokenizer and chat template, loaded the way the engine loads them.

The directory holds what a Hugging Face model repository ships: ``tokenizer.json`` (the
fast tokenizer, read with the ``tokenizers`` library, as transformers does) and
``tokenizer_config.json`` (special tokens and, usually, ``chat_template``: one string,
or a list of named templates, of which ``tool_use`` is taken when tools are given);
newer repositories keep the template in ``chat_template.jinja`` instead. Chat prompts
are encoded without the tokenizer's own special tokens (vLLM's chat default,
``add_special_tokens=False``): the template writes them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Encoding, Tokenizer

from router.errors import ConfigError
from router.tokens.template import ChatTemplate

# The special-token attributes transformers passes to templates (its special_tokens_map).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Pre-tokenizers and normalizers that treat the start of the text unlike the rest (a
# prefix space added "first"): a suffix encoded alone would not match the whole.
_START_SENSITIVE = ("Metaspace", "Prepend")


@dataclass(frozen=True, slots=True)
class ModelTokenizer:
    directory: Path
    tokenizer: Tokenizer
    templates: Mapping[str, ChatTemplate]  # by name; "default" unless the config names them
    # Added tokens the tokenizer always cuts out whole (no stripping, not normalized):
    # the text on either side of one encodes on its own, which is what makes encoding
    # only a prompt's new text exact (router.tokens.incremental).
    boundaries: tuple[str, ...]
    start_sensitive: bool

    @classmethod
    def from_dir(cls, directory: str | Path) -> ModelTokenizer:
        root = Path(directory)
        tokenizer_file = root / "tokenizer.json"
        config_file = root / "tokenizer_config.json"
        for needed in (tokenizer_file, config_file):
            if not needed.is_file():
                raise ConfigError(f"prefix.tokenizer: {root} has no {needed.name}")
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
            spec = json.loads(tokenizer_file.read_text())
            config = json.loads(config_file.read_text())
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file
            raise ConfigError(f"prefix.tokenizer: cannot read {root}: {exc}") from exc
        # transformers turns off what a tokenizer.json may carry for training batches:
        # pads inside a prompt's ids, or a prompt cut short, would key it wrongly.
        tokenizer.no_padding()
        tokenizer.no_truncation()
        if config.get("split_special_tokens"):
            raise ConfigError(
                f"prefix.tokenizer: {root} sets split_special_tokens (special tokens "
                "encoded as text), which the router does not reproduce"
            )
        special = _special_tokens(config)
        sources = _template_sources(root, config)
        if not sources:
            raise ConfigError(f"prefix.tokenizer: {root} has no chat template")
        templates = {name: ChatTemplate(source, special) for name, source in sources.items()}
        added = [a for a in spec.get("added_tokens", []) if isinstance(a.get("content"), str)]
        contents = [a["content"] for a in added]
        boundaries = tuple(
            token["content"]
            for token in added
            if not (token.get("lstrip") or token.get("rstrip") or token.get("single_word"))
            and not token.get("normalized", False)
            and not _inside_another(token["content"], contents)
        )
        shape = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")])
        return cls(
            directory=root,
            tokenizer=tokenizer,
            templates=templates,
            boundaries=boundaries,
            start_sensitive=any(kind in shape for kind in _START_SENSITIVE),
        )

    def template(self, with_tools: bool = False) -> ChatTemplate:
        """The template transformers would pick: ``tool_use`` when tools are given and
        there is one, else ``default`` (or the only one)."""
        if with_tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        return next(iter(self.templates.values()))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as the engine encodes a rendered chat prompt."""
        ids: list[int] = self.encoding(text).ids
        return ids

    def encoding(self, text: str) -> Encoding:
        # encode_batch, not encode: only it lets go of the GIL while it works, so a long
        # prompt encoded on the tokenizer's thread does not stall the event loop.
        encoding: Encoding = self.tokenizer.encode_batch([text], add_special_tokens=False)[0]
        return encoding

    def boundary_pattern(self) -> re.Pattern[str] | None:
        """Occurrences of the boundary tokens, longest first (so a token that contains
        another is found whole); None when there are none."""
        if not self.boundaries:
            return None
        ordered = sorted(set(self.boundaries), key=len, reverse=True)
        return re.compile("|".join(re.escape(token) for token in ordered))


def _inside_another(token: str, contents: list[str]) -> bool:
    """A token that is part of a longer added token is cut out only where the longer one
    is not: a cut after it is not a safe place."""
    return any(token in other and token != other for other in contents)


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    found = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, Mapping):  # a serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    return found


def _template_sources(root: Path, config: Mapping[str, Any]) -> dict[str, str]:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return {"default": jinja_file.read_text()}
    value = config.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {
            str(entry["name"]): str(entry["template"])
            for entry in value
            if isinstance(entry, Mapping) and "name" in entry and "template" in entry
        }
    return {}
