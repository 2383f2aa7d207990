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

from tokenizers import Tokenizer

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
        special = _special_tokens(config)
        sources = _template_sources(root, config)
        if not sources:
            raise ConfigError(f"prefix.tokenizer: {root} has no chat template")
        templates = {name: ChatTemplate(source, special) for name, source in sources.items()}
        boundaries = tuple(
            added["content"]
            for added in spec.get("added_tokens", [])
            if not (added.get("lstrip") or added.get("rstrip") or added.get("single_word"))
            and not added.get("normalized", False)
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
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def boundary_pattern(self) -> re.Pattern[str] | None:
        """Occurrences of the boundary tokens, longest first (so a token that contains
        another is found whole); None when there are none."""
        if not self.boundaries:
            return None
        ordered = sorted(set(self.boundaries), key=len, reverse=True)
        return re.compile("|".join(re.escape(token) for token in ordered))


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
